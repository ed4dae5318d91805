"""The tier contracts (`kvtier.tiers.contract`): every tier answers `Tier` (the paired verbs),
the slot tiers `SlotTierContract` too, and the shared tier nothing it would answer with a no-op;
together they are exactly the calls the controller makes, which asks the shared tier `Tier` only.
Every data plane has one verb set returning per-block outcomes (no out-parameter lists)."""

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
from kvtier.tiers.contract import DataPlane, Medium, SlotTierContract, Tier
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
    parameter annotated `Tier` or `SlotTierContract`."""
    def is_tiers(e: ast.AST) -> bool:
        return "self.tiers" in ast.unparse(e)

    names: set[str] = set()
    for a in fn.args.args if isinstance(fn, ast.FunctionDef) else []:
        if a.annotation is not None and ast.unparse(a.annotation) in ("Tier", "SlotTierContract"):
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


# what `Tier` declares for the drivers (stack, connector, executor), not the controller
FOR_DRIVERS = {"kind", "medium", "data_plane", "summary", "drain"}


def test_the_contracts_list_exactly_the_calls_the_controller_makes():
    used = _controller_calls()
    tier, slot = _protocol_members(Tier), _protocol_members(SlotTierContract)
    assert used - tier - slot == set(), f"the controller calls what the contracts lack: {sorted(used - tier - slot)}"
    assert slot - used == set(), f"the slot contract lists what the controller never calls: {sorted(slot - used)}"
    assert tier - used == FOR_DRIVERS, f"Tier lists what nobody calls: {sorted(tier - used - FOR_DRIVERS)}"
    assert {"lookup", "holds", "prepare_load", "complete_load", "complete_store", "touch"} <= used   # the walk sees them


def test_the_controller_asks_the_shared_tier_only_the_tier_contract():
    """`self.tiers[self.shared]` (and a tier the controller checked `.shared` on) gets `Tier` calls only."""
    tier = _protocol_members(Tier)
    asked = {node.attr for path in CONTROLLER for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Attribute) and ast.unparse(node.value) == "self.tiers[self.shared]"}
    assert asked and asked <= tier, sorted(asked - tier)


def test_the_controller_has_no_branch_on_which_tier_is_shared():
    """No `t == self.shared` / `t != self.shared`: it branches on declarations (`tier.shared`,
    a local tier's index below `nlocal`)."""
    for path in CONTROLLER:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops):
                assert "self.shared" not in ast.unparse(node), f"{path.name}: {ast.unparse(node)}"


def _takes_the_contracts_keywords(t, proto) -> list[str]:
    """Members of `proto` whose parameters `t`'s method lacks."""
    bad = []
    for m in _protocol_members(proto):
        want, have = getattr(proto, m, None), getattr(t, m)
        if callable(want) and not isinstance(getattr(type(t), m, None), property):
            ps = [p for p in inspect.signature(want).parameters if p != "self"]
            if not set(ps) <= set(inspect.signature(have).parameters):
                bad.append(m)
    return bad


def test_every_tier_implements_its_contract(tmp_path, redis_server):
    """Every tier answers `Tier`; the slot tiers `SlotTierContract` too; the shared tiers have none
    of the slot tier's members."""
    cfg = parse_config({"block_bytes": 4096, "model": "m", "tiers": [
        {"name": "cpu", "kind": "cpu", "capacity_blocks": 4},
        {"name": "shared", "kind": "redis", "url": redis_server.url}]}, check_env=False)
    redis = SharedTier("shared", RedisSettings.of(cfg.tiers[1]), cfg.fingerprint(), 4096)
    slots = [SlotTier("s", 4, 64, LRU(4)), CpuTier("cpu", 4, 4096, LRU(4), with_data=False),
             NvmeTier("nvme", str(tmp_path / "n"), 4, 4096, LRU(4), io="posix"),
             ClosedTier("nvme", Medium.FILE, False, 4096, "not open")]
    shared = [SimSharedTier("sim", 4, 64), redis]
    slot_only = _protocol_members(SlotTierContract) - _protocol_members(Tier)
    try:
        for t in slots + shared:
            missing = sorted(m for m in _protocol_members(Tier) if not hasattr(t, m))
            assert not missing and isinstance(t, Tier), f"{type(t).__name__} lacks {missing}"
            assert not _takes_the_contracts_keywords(t, Tier), type(t).__name__
        for t in slots:
            assert isinstance(t, SlotTierContract), type(t).__name__
            assert not _takes_the_contracts_keywords(t, SlotTierContract), type(t).__name__
        for t in shared:
            assert t.shared and not isinstance(t, SlotTierContract)
            assert sorted(m for m in slot_only if hasattr(t, m)) == [], type(t).__name__
    finally:
        for t in slots + shared:
            t.close()


def _is_no_op(fn: ast.FunctionDef) -> bool:
    """A body of only a docstring, `pass`, `...` and/or `return <constant, [], {}, ()>`."""
    for st in fn.body:
        if isinstance(st, ast.Pass) or (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant)):
            continue
        if isinstance(st, ast.Return) and (st.value is None or isinstance(st.value, ast.Constant) or (
                isinstance(st.value, (ast.List, ast.Tuple, ast.Dict, ast.Set)) and not ast.unparse(st.value)[1:-1])):
            continue
        return False
    return True


def test_the_shared_tier_classes_define_no_no_op_contract_member():
    """What the issue removed: a shared tier answering the slot calls with nothing. Every contract
    member a shared tier class defines does something (the lifecycle hooks a class has nothing
    for come from `Tier` itself)."""
    members = _protocol_members(Tier) | _protocol_members(SlotTierContract)
    tree = ast.parse((ROOT / "tiers/shared.py").read_text())
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    assert {"_SharedBase", "SharedTier", "SimSharedTier"} <= set(classes)
    no_ops = [f"{c}.{f.name}" for c, cls in classes.items() if c in ("_SharedBase", "SharedTier", "SimSharedTier")
              for f in cls.body if isinstance(f, ast.FunctionDef) and f.name in members and _is_no_op(f)]
    assert no_ops == []
    assert _is_no_op(ast.parse("def f(self):\n    \"\"\"doc\"\"\"\n    return []").body[0])   # the check sees one


def test_the_shared_tier_answers_its_verbs_by_key():
    """A load names its blocks by key and refreshes them; a store's written blocks are known (a
    failed one is not); a load's gone or bad blocks are not known any more."""
    t = SimSharedTier("shared", 8, 64)
    keys = [block_key(1, i) for i in range(3)]
    t.complete_store([], keys, [0, 0, 0])
    assert t.prepare_load([-1] * 3, keys[:1], True) == (None, keys[:1])   # keys[0] refreshed: keys[1] is oldest
    t.complete_store([], [block_key(2, i) for i in range(7)], [0, 0, 0, 0, 0, 0, -1])
    assert [t.holds(k) for k in keys] == [True, False, True] and not t.holds(block_key(2, 6))
    t.complete_load(bad=keys[:1], gone=keys[2:])
    assert t.lookup(keys) == 0 and not t.holds(keys[2])


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
    assert all(shared.holds(k) for k in keys) and c.pinned_blocks() == 0
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
