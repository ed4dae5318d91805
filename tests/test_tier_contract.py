"""The tier contract (`kvtier.tiers.contract`): every tier implements exactly the calls the
controller makes, the controller runs one path whichever tier is the shared one, and every data
plane has one verb set returning per-block outcomes (no out-parameter lists)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import torch

from kvtier.core.config import parse_config
from kvtier.core.controller import TierController
from kvtier.offline.blockgen import block_data, block_key
from kvtier.policies.lru import LRU
from kvtier.tiers.base import SlotTier
from kvtier.tiers.closed import ClosedTier
from kvtier.tiers.contract import DataPlane, Medium, Tier
from kvtier.tiers.cpu import CpuTier
from kvtier.tiers.cpu_pool import CpuPool
from kvtier.tiers.nvme import NvmeTier
from kvtier.tiers.shared import SharedTier, SimSharedTier
from kvtier.tiers.shared_conn import RedisSettings

ROOT = Path(__file__).resolve().parents[1]
CONTROLLER = [ROOT / "kvtier/core/controller.py", ROOT / "kvtier/core/ledger.py"]


def _protocol_members(proto) -> set[str]:
    out = set(getattr(proto, "__annotations__", {}))
    for name, v in vars(proto).items():
        if not name.startswith("_") and (callable(v) or isinstance(v, property)):
            out.add(name)
    return out


def _tier_names(fn: ast.AST) -> set[str]:
    """Names bound to a tier in a function: from `self.tiers[...]`, a loop over `self.tiers`, or a
    parameter annotated `Tier`."""
    def is_tiers(e: ast.AST) -> bool:
        return "self.tiers" in ast.unparse(e)

    names: set[str] = set()
    for a in fn.args.args if isinstance(fn, ast.FunctionDef) else []:
        if a.annotation is not None and ast.unparse(a.annotation) == "Tier":
            names.add(a.arg)
    for node in ast.walk(fn):
        pairs = []
        if isinstance(node, ast.Assign):
            for tgt in node.targets:
                if isinstance(tgt, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    pairs += list(zip(tgt.elts, node.value.elts))
                else:
                    pairs.append((tgt, node.value))
        elif isinstance(node, (ast.For, ast.comprehension)):
            tgt = node.target.elts[-1] if isinstance(node.target, ast.Tuple) else node.target
            pairs.append((tgt, node.iter))
        for tgt, val in pairs:
            if isinstance(tgt, ast.Name) and isinstance(val, (ast.Subscript, ast.Call, ast.Attribute)) \
                    and is_tiers(val):
                names.add(tgt.id)
    return names


def _controller_calls() -> set[str]:
    """Every attribute the controller reads or calls on a tier."""
    used: set[str] = set()
    for path in CONTROLLER:
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, ast.FunctionDef):
                continue
            names = _tier_names(fn)
            for node in ast.walk(fn):
                if not isinstance(node, ast.Attribute):
                    continue
                v = node.value
                if (isinstance(v, ast.Name) and v.id in names) or \
                        (isinstance(v, ast.Subscript) and ast.unparse(v.value) == "self.tiers"):
                    used.add(node.attr)
    return used


def test_the_contract_lists_exactly_the_calls_the_controller_makes():
    used = _controller_calls()
    declared = _protocol_members(Tier)
    assert used - declared == set(), f"the controller calls what the contract lacks: {sorted(used - declared)}"
    assert declared - used == set(), f"the contract lists what the controller never calls: {sorted(declared - used)}"
    assert {"probe", "touch", "commit_written", "load_fields", "note_gone"} <= used   # the walk sees the calls


def test_the_controller_has_no_branch_on_which_tier_is_shared():
    """One path: no `t == self.shared` / `t != self.shared`; the shared tier answers the slot calls."""
    for path in CONTROLLER:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops):
                assert "self.shared" not in ast.unparse(node), f"{path.name}: {ast.unparse(node)}"


def test_every_tier_implements_the_whole_contract(tmp_path, redis_server):
    cfg = parse_config({"block_bytes": 4096, "model": "m", "tiers": [
        {"name": "cpu", "kind": "cpu", "capacity_blocks": 4},
        {"name": "shared", "kind": "redis", "url": redis_server.url}]}, check_env=False)
    redis = SharedTier("shared", RedisSettings.of(cfg.tiers[1]), cfg.fingerprint(), 4096)
    tiers = [SlotTier("s", 4, 64, LRU(4)), CpuTier("cpu", 4, 4096, LRU(4), with_data=False),
             NvmeTier("nvme", str(tmp_path / "n"), 4, 4096, LRU(4), io="posix"),
             ClosedTier("nvme", Medium.FILE, False, 4096, "not open"), SimSharedTier("sim", 4, 64), redis]
    try:
        members, bad = _protocol_members(Tier), []
        for t in tiers:
            missing = sorted(m for m in members if not hasattr(t, m))
            assert not missing, f"{type(t).__name__} lacks {missing}"
            assert isinstance(t, Tier)
            for m in members:   # a method the contract calls with keywords takes them
                want, have = getattr(Tier, m, None), getattr(t, m)
                if callable(want) and not isinstance(getattr(type(t), m, None), property):
                    ps = [p for p in inspect.signature(want).parameters if p != "self"]
                    if not set(ps) <= set(inspect.signature(have).parameters):
                        bad.append((type(t).__name__, m))
        assert not bad, bad
    finally:
        for t in tiers:
            t.close()


def test_the_shared_tier_answers_the_slot_calls_as_a_tier_without_slots():
    """What lets the controller run one path: nothing to pin, no slot, never short of room."""
    t = SimSharedTier("shared", 8, 64)
    keys = [block_key(1, i) for i in range(3)]
    assert t.allocate(keys) == [] and t.free_slots(5) == [] and t.evict([1]) == []
    t.touch([-1, -1]), t.free_blocks([-1, -1])
    assert t.pinned_blocks() == 0 and t.find(keys[0]) is None and t.num_free_slots >= 1 << 30
    assert t.load_fields([-1] * 3, keys, True) == (None, keys)
    t.note_written(keys)
    t.hit([-1] * 3, keys=keys[:1])      # a use refreshes the key: the LRU's oldest is now keys[1]
    t.note_written([block_key(2, i) for i in range(6)])
    assert [t.known(k) for k in keys] == [True, False, True]


def test_a_controller_over_a_shared_tier_pins_and_copies_through_one_path():
    """The controller over cpu + a shared tier: a store is written through with no slot, a hit on
    the shared tier is leased without a pin, and the report makes the blocks known."""
    from kvtier.core.plan import Report
    cpu, shared = SlotTier("cpu", 4, 64, LRU(4)), SimSharedTier("shared", 0, 64)
    c = TierController([cpu, shared])
    keys = [block_key(3, i) for i in range(3)]
    want, op_id, _ = c.store(keys, [0, 1, 2])
    plan = c.take_plan()
    assert want == [0, 1, 2] and [(cp.tier, cp.slots, cp.keys) for cp in plan.copies] == [(1, [], keys)]
    c.complete(Report(stored={op_id: [True] * 3}, copied={plan.copies[0].op_id: [0, 0, 0]}))
    assert all(shared.known(k) for k in keys) and c.pinned_blocks() == 0
    c.clear()
    assert c.acquire("r", keys) is not None and c.pinned_blocks() == 0   # leased, nothing pinned
    ops = c.load("r", 3, [7, 8, 9])
    assert [(op.tier, op.keys, op.checksums) for op in ops] == [(1, keys, None)]


def _nvme_plane(tmp_path):
    t = NvmeTier("nvme", str(tmp_path / "d"), 8, 8192, LRU(8), io="posix")
    return t, t.data_plane


def test_every_data_plane_has_one_verb_set(tmp_path, redis_server):
    cfg = parse_config({"block_bytes": 4096, "model": "m", "tiers": [
        {"name": "cpu", "kind": "cpu", "capacity_blocks": 4},
        {"name": "shared", "kind": "redis", "url": redis_server.url}]}, check_env=False)
    redis = SharedTier("shared", RedisSettings.of(cfg.tiers[1]), cfg.fingerprint(), 4096)
    nvme, plane = _nvme_plane(tmp_path)
    pool = CpuPool(2, 4096, pin=False)
    try:
        for p in (pool, plane, redis.data_plane):
            assert isinstance(p, DataPlane), type(p).__name__
            assert list(inspect.signature(p.read).parameters)[:4] == ["slots", "dsts", "keys", "expect"]
            assert list(inspect.signature(p.write).parameters)[:3] == ["slots", "srcs", "keys"]
    finally:
        pool.close()
        nvme.close()
        redis.close()


def test_file_plane_returns_tags_and_bad_blocks_in_its_result(tmp_path):
    """No out-parameter lists: a write's tags and a read's failed verifications are per-block
    outcomes in the IOResult."""
    nvme, plane = _nvme_plane(tmp_path)
    try:
        keys = [block_key(5, i) for i in range(3)]
        data = [block_data(5, i, 8192) for i in range(3)]
        slots = nvme.allocate(keys)
        w = plane.write(slots, data, keys).wait()
        assert w.all_ok and len(w.tags) == 3 and all(isinstance(c, int) and c for c in w.tags)
        plane.sync()
        nvme.commit_written(slots, w.tags)
        assert nvme.checksums(slots) == w.tags
        with open(plane.path, "r+b") as f:   # flip a payload byte of the middle block
            f.seek(slots[1] * plane.stride + plane.stride - 1)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0xFF]))
        out = [torch.zeros(8192, dtype=torch.uint8) for _ in keys]
        r = plane.read(slots, out, keys, nvme.checksums(slots)).wait()
        assert r.ok == [True, False, True] and r.bad == [False, True, False]
        assert torch.equal(out[0], data[0]) and torch.equal(out[2], data[2])
    finally:
        nvme.close()
