"""A block whose load failed, for any reason, is not offered again until it is rewritten (issue 33
item 2): the controller's one memory (`kvtier.core.ledger`), on real tiers (DRAM, NVMe files,
a real redis-server). Each failure kind (EIO, EISDIR, a short read of a truncated file, a data file
that cannot be opened, a failed verification, a copy into the KV that failed) is remembered for
a one-group lookup (a prefix) and a several-group one (exact keys: `find` / `acquire_keys`), a
fresh store forgets it, and the memory stays within its cap."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from hypothesis import given, settings, strategies as st

from kvtier.core.config import parse_config
from kvtier.core.executor import Executor
from kvtier.core.ledger import FailedLoads
from kvtier.core.outside import Buffers
from kvtier.core.stack import TierStack
from kvtier.offline.blockgen import block_data, block_key
from kvtier.tiers import io_engine as io_hooks
from kvtier.tiers.nvme_block import HEADER_BYTES, slot_stride
from kvtier.tiers.nvme_dir import data_file

BB = 8192
N = 12            # blocks put: DRAM keeps 8, NVMe all 12
KINDS = ["EIO", "EISDIR", "short", "open", "verify"]


def _stack(tmp_path):
    cfg = parse_config({"block_bytes": BB, "model": "m", "tiers": [
        {"name": "cpu", "kind": "cpu", "capacity_blocks": 8},
        {"name": "nvme", "kind": "nvme", "path": str(tmp_path / "nvme"), "capacity_blocks": 64, "io": "posix"}],
        "policy": {"promotion": "none", "demotion": "write_through"}}, check_env=False)
    s = TierStack.from_config(cfg)
    keys, data = [block_key(5, i) for i in range(N)], [block_data(5, i, BB) for i in range(N)]
    assert s.put(keys, data) == N
    assert s.ctrl.total("stored_blocks.nvme") == N
    order = sorted(range(N), key=lambda i: s.ctrl.find(keys[i])[0] == 0)   # the 4 only on NVMe first
    keys, data = [keys[i] for i in order], [data[i] for i in order]
    assert [s.ctrl.find(k)[0] for k in keys] == [1] * 4 + [0] * 8
    return s, keys, data


def _break(kind, s, keys, tmp_path, monkeypatch):
    """Make the NVMe loads of keys[:4] fail with `kind`; returns the executor to load with."""
    if kind in ("EIO", "EISDIR"):
        monkeypatch.setattr(io_hooks.HOOKS, "counts", {})
        monkeypatch.setattr(io_hooks.HOOKS, "fault", ("read", kind, 1))
    elif kind == "short":                      # the data file truncated under the tier: preadv reads 0 bytes
        os.truncate(tmp_path / "nvme" / data_file(0), 0)
    elif kind == "verify":                     # a payload byte flipped in each block's slot
        with open(tmp_path / "nvme" / data_file(0), "r+b") as f:
            for k in keys[:4]:
                at = s.tiers[1].find(k) * slot_stride(BB) + HEADER_BYTES + 100
                f.seek(at)
                b = f.read(1)
                f.seek(at)
                f.write(bytes([b[0] ^ 0xFF]))
    else:                                      # "open": this process has no NVMe data plane
        return Executor(Buffers([], BB), [s.tiers[0].data_plane, None], BB, tier_names=s.ctrl.names,
                        count=s.ctrl.count)
    return s.executor


def _load(s, ex, rid, keys, chain):
    """Lease (a prefix, or exactly `keys` as a hybrid hit does), load, complete: blocks loaded."""
    lease = s.ctrl.acquire(rid, keys) if chain else s.ctrl.acquire_keys(rid, keys)
    assert lease is not None and lease.num_blocks == len(keys)
    s.ctrl.load(rid, len(keys), list(range(len(keys))))
    out = [torch.zeros(BB, dtype=torch.uint8) for _ in keys]
    ex.bind(Buffers(out, BB))
    rep = ex.run(s.ctrl.take_plan())
    bad = ex.take_load_errors()
    s.ctrl.complete(rep)
    s.ctrl.release(rid)
    return len(keys) - len(bad)


@pytest.mark.parametrize("chain", [True, False], ids=["one_group", "groups"])
@pytest.mark.parametrize("kind", KINDS)
def test_failed_nvme_load_is_not_offered_until_rewritten(tmp_path, monkeypatch, caplog, kind, chain):
    s, keys, data = _stack(tmp_path)
    try:
        ex = _break(kind, s, keys, tmp_path, monkeypatch)
        want = keys[:4] if chain else [keys[0], keys[2], keys[1], keys[3]]   # two "groups"' blocks
        with caplog.at_level(logging.WARNING, logger="kvtier.core.controller"):
            assert _load(s, ex, "r1", want, chain) == 0
        # no lookup offers them: not the prefix, not a block, not a several-group hit
        assert all(s.ctrl.find(k) is None for k in keys[:4]) and s.ctrl.acquire_keys("r2", keys[:4]) is None
        assert s.lookup(keys) == 0 and s.lookup(keys[4:]) == N - 4 and s.ctrl.find(keys[4]) is not None
        t = s.ctrl.totals
        assert t["failed_load_blocks.nvme"] == 4 and t["blocks_load_failed.nvme"] == 4
        assert len([r for r in caplog.records if "not offered again until rewritten" in r.getMessage()]) == 1
        # an I/O-failed block keeps its index entry and its bytes; a bad one is quarantined
        assert sum(k in s.tiers[1] for k in keys[:4]) == (0 if kind == "verify" else 4)
        # a second load attempt cannot happen: nothing more fails
        assert s.get(keys[:4], [torch.zeros(BB, dtype=torch.uint8) for _ in range(4)]) == 0
        assert s.ctrl.totals["blocks_load_failed.nvme"] == 4
        # a fresh store forgets them: found again (DRAM), served byte-exact
        assert s.put(keys[:4], data[:4]) == 4
        assert s.lookup(keys[:4]) == 4 and len(s.ctrl.failed) == 0
        assert _load(s, s.executor, "r3", want, chain) == 4
        got = [torch.zeros(BB, dtype=torch.uint8) for _ in range(4)]
        assert s.get(keys[:4], got) == 4 and all(torch.equal(g, d) for g, d in zip(got, data[:4]))
    finally:
        monkeypatch.setattr(io_hooks.HOOKS, "fault", None)
        s.close()


def test_failed_dram_load_is_stored_afresh(tmp_path, monkeypatch):
    """A DRAM block whose copy into the KV failed: not offered; the next store replaces its copy."""
    s, keys, data = _stack(tmp_path)
    try:
        monkeypatch.setattr(io_hooks.HOOKS, "counts", {})
        monkeypatch.setattr(io_hooks.HOOKS, "fault", ("load_copy", "error", 1))
        assert _load(s, s.executor, "r1", keys[8:], True) == 0
        monkeypatch.setattr(io_hooks.HOOKS, "fault", None)
        assert s.lookup(keys[8:]) == 0 and s.ctrl.totals["failed_load_blocks.cpu"] == 4
        assert s.put(keys[8:], data[8:]) == 4                         # stored afresh, not skipped as held
        got = [torch.zeros(BB, dtype=torch.uint8) for _ in range(4)]
        assert s.get(keys[8:], got) == 4 and all(torch.equal(g, d) for g, d in zip(got, data[8:]))
        assert s.ctrl.totals["hit_blocks.cpu"] == 8
    finally:
        s.close()


def test_failed_shared_tier_load_is_not_offered_until_rewritten(redis_server, monkeypatch):
    """The shared tier (a real redis-server): a value that was read but whose copy into the KV
    failed is still on the server; the lookup no longer offers it until a fresh store."""
    cfg = parse_config({"block_bytes": BB, "model": "m", "tiers": [
        {"name": "cpu", "kind": "cpu", "capacity_blocks": 8},
        {"name": "shared", "kind": "redis", "url": redis_server.url, "timeout_s": 5, "connect_timeout_s": 5,
         "secret": "s"}]}, check_env=False)
    keys, data = [block_key(77, i) for i in range(4)], [block_data(77, i, BB) for i in range(4)]
    with TierStack.from_config(cfg) as a:
        assert a.put(keys, data) == 4
    with TierStack.from_config(cfg) as s:                     # an empty DRAM tier: the server serves them
        assert s.lookup(keys) == 4
        monkeypatch.setattr(io_hooks.HOOKS, "counts", {})
        monkeypatch.setattr(io_hooks.HOOKS, "fault", ("load_copy", "error", 1))
        assert _load(s, s.executor, "r1", keys, True) == 0
        monkeypatch.setattr(io_hooks.HOOKS, "fault", None)
        assert s.lookup(keys) == 0 and s.ctrl.totals["failed_load_blocks.shared"] == 4
        assert s.put(keys, data) == 4
        got = [torch.zeros(BB, dtype=torch.uint8) for _ in range(4)]
        assert s.get(keys, got) == 4 and all(torch.equal(g, d) for g, d in zip(got, data))


def test_memory_is_capped_and_counts_what_it_forgets(tmp_path, monkeypatch):
    s, keys, data = _stack(tmp_path)
    try:
        monkeypatch.setattr(s.ctrl, "failed", FailedLoads(cap=2))
        monkeypatch.setattr(io_hooks.HOOKS, "counts", {})
        monkeypatch.setattr(io_hooks.HOOKS, "fault", ("read", "EIO", 1))
        assert _load(s, s.executor, "r1", keys[:4], True) == 0
        t = s.ctrl.totals
        assert len(s.ctrl.failed) == 2 and t["failed_loads_forgotten"] == 2 and t["failed_load_blocks.nvme"] == 4
        assert s.lookup(keys) == 2          # the oldest two forgotten: offered once more
    finally:
        monkeypatch.setattr(io_hooks.HOOKS, "fault", None)
        s.close()


OPS = st.lists(st.tuples(st.sampled_from(["add", "forget"]), st.lists(st.integers(0, 9), max_size=4)), max_size=40)


@settings(max_examples=200, deadline=None)
@given(cap=st.integers(1, 6), ops=OPS)
def test_failed_loads_is_a_capped_lru(cap, ops):
    """Against a model: at most `cap` keys, the least recently failed forgotten first, a forgotten
    or rewritten key no longer remembered, `clean` the prefix before the first remembered key."""
    m = FailedLoads(cap)
    model: list[int] = []
    for op, ks in ops:
        keys = [bytes([k]) for k in ks]
        if op == "add":
            new = gone = 0
            for k in ks:
                if k in model:
                    model.remove(k)
                else:
                    new += 1
                model.append(k)
                if len(model) > cap:
                    model.pop(0)
                    gone += 1
            assert m.add(keys) == (new, gone)
        else:
            n = sum(1 for k in dict.fromkeys(ks) if k in model)
            model = [k for k in model if k not in ks]
            assert m.forget(keys) == n
        assert len(m) == len(model) <= cap
        assert all((bytes([k]) in m) == (k in model) for k in range(10))
        probe = [bytes([k]) for k in range(10)]
        assert m.clean(probe) == next((i for i in range(10) if i in model), 10)
