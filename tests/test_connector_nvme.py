"""NVMe tier in the connector without vLLM: the scheduler's control plane (LMDB index, no data file)
and the worker's data plane (data file, no index) talk only through the step metadata."""

from __future__ import annotations

import os
import sys

import torch

from kvtier.tiers.nvme_control import NvmeControl
from kvtier.connector.worker import KVTierWorker
from kvtier.policies import EVICTION
from kvtier.tiers.base import SlotTier

sys.path.insert(0, os.path.dirname(__file__))
from parts_util import scheduler, worker_settings  # noqa: E402
from test_connector_scheduler import BT, Req  # noqa: E402

NB, H, D2 = 16, 2, 64


def caches(seed):
    g = torch.Generator().manual_seed(seed)
    buf = torch.randn(2, NB, H, BT, D2, generator=g)
    return {f"l{i}": buf[i] for i in range(2)}


def sched(path, cap=8, ranks=1, reporters=None):
    bb = 2 * H * BT * D2 * 4
    cpu = SlotTier("cpu", cap, bb, EVICTION.get("lru")(cap))
    nv = NvmeControl("nvme", str(path), 16, bb, EVICTION.get("lru")(16), {"model": "t"})
    return scheduler([cpu, nv], BT, ranks=ranks, reporters=reporters), cpu, nv


def worker(seed, lag=0, rank=0):
    w = KVTierWorker(worker_settings(8, nvme_direct="auto", nvme_write_lag_steps=lag), rank=rank)
    c = caches(seed)
    w.register_kv_caches(c)
    return w, c


def step(s, w, scheduled):
    meta = s.build_meta([(q, n, None if ids is None else [ids]) for q, n, ids in scheduled])
    w.bind(meta)
    w.start_load()
    w.save()
    s.on_worker_meta(w.take_report())
    return meta


def test_write_through_restart_and_corruption(tmp_path):
    d = tmp_path / "nvme"
    r = Req("a", list(range(4 * BT + 3)))                       # 4 full blocks
    ids = [1, 2, 3, 4, 5]
    s, cpu, nv = sched(d)
    w, c = worker(0)
    s.lookup(r, 0)
    s.on_alloc(r, [ids], 0)
    meta = step(s, w, [("a", r.num_tokens, ids)])
    assert s.totals["store_planned_blocks.nvme"] == 4 and meta.nvme_dir == nv.dir
    assert nv.num_resident == 4 and cpu.num_resident == 4 and s.pinned_blocks() == 0
    assert len(nv.index) == 4                                    # committed after the worker's report
    want = [torch.cat([c[n][b].reshape(-1).view(torch.uint8) for n in c]) for b in ids[:4]]
    s.close()
    w.close()

    # restart: new scheduler (index restored), new worker with other GPU contents, empty CPU tier
    s, cpu, nv = sched(d)
    w, c = worker(1)
    assert nv.restored_blocks == 4 and cpu.num_resident == 0
    r2 = Req("b", r.tokens)
    assert s.lookup(r2, 0) == 4 * BT
    dst = [9, 10, 11, 12, 13]
    s.on_alloc(r2, [dst], 4 * BT)
    step(s, w, [("b", r2.num_tokens, dst)])
    got = [torch.cat([c[n][b].reshape(-1).view(torch.uint8) for n in c]) for b in dst[:4]]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert cpu.num_resident == 4                                 # promoted on read
    assert w.take_load_errors() == set() and s.pinned_blocks() == 0
    s.on_finished("b")

    # corrupt one block on disk; evict the CPU copies so NVMe serves the lookup
    s.close()
    w.close()
    s, cpu, nv = sched(d)
    w, c = worker(2)
    r3 = Req("c", r.tokens)
    s._track(r3)
    slot = nv.find(s._reqs["c"].keys[1])
    with open(os.path.join(nv.dir, "data.0"), "r+b") as f:
        f.seek(slot * nv.stride + 7)
        f.write(b"\xff\x00\xff")
    assert s.lookup(r3, 0) == 4 * BT
    s.on_alloc(r3, [dst], 4 * BT)
    step(s, w, [("c", r3.num_tokens, dst)])
    assert w.take_load_errors() == {dst[1]}                      # recompute that block (and after)
    assert w.corrupt_blocks == 1 and s.totals["corrupt_blocks.nvme"] == 1
    assert s._reqs["c"].keys[1] not in nv and len(nv.index) == 3
    s.on_finished("c")
    assert s.pinned_blocks() == 0
    s.close()
    w.close()


def test_write_behind_reports_within_lag(tmp_path):
    """NVMe writes run behind the step: the index commits only after the report, the CPU source
    stays pinned until then, and the report comes at the latest `lag` steps later."""
    import threading
    d = tmp_path / "nvme"
    lag = 3
    s, cpu, nv = sched(d)
    w, c = worker(0, lag=lag)
    gate = threading.Event()
    r = Req("a", list(range(4 * BT + 3)))
    ids = [1, 2, 3, 4, 5]
    s.lookup(r, 0)
    s.on_alloc(r, [ids], 0)
    meta = s.build_meta([("a", r.num_tokens, [ids])])
    w.bind(meta)
    w.start_load()
    w.save()                                    # GPU -> CPU now; the NVMe write is queued
    real_sync = w.nvme.sync
    w.nvme.sync = lambda: (gate.wait(30), real_sync())
    try:
        s.on_worker_meta(w.take_report())
        assert cpu.num_resident == 4 and len(nv.index) == 0 and w.writes_in_flight == 1
        assert sum(cpu._ref) == 4                   # the CPU copies are the write's source
        assert s.lookup(Req("b", r.tokens), 0) == 4 * BT   # served from the CPU tier meanwhile
        s.on_finished("b")
    finally:
        gate.set()
    for _ in range(lag):
        step(s, w, [])
    assert w.writes_in_flight == 0 and len(nv.index) == 4 and s.pinned_blocks() == 0
    assert s.totals["stored_blocks.nvme"] == 4 and w.totals["blocks_stored.nvme"] == 4
    s.close()
    w.close()
    s, cpu, nv = sched(d)
    assert nv.restored_blocks == 4
    s.close()


def test_write_behind_unreported_at_close_is_not_indexed(tmp_path):
    d = tmp_path / "nvme"
    s, cpu, nv = sched(d)
    w, c = worker(0, lag=8)
    r = Req("a", list(range(2 * BT + 1)))
    s.lookup(r, 0)
    s.on_alloc(r, [[1, 2, 3]], 0)
    meta = s.build_meta([("a", r.num_tokens, [[1, 2, 3]])])
    w.bind(meta)
    w.start_load()
    w.save()
    w.close()                                   # written and synced, but never reported
    s.close()
    assert w.totals["nvme_unreported_blocks"] == 2 and s.totals["uncommitted_at_close"] == 2
    s, cpu, nv = sched(d)
    assert nv.restored_blocks == 0 and s.lookup(Req("b", r.tokens), 0) == 0
    s.close()


def test_nvme_admission_second_hit(tmp_path):
    """`second_hit` on the NVMe tier: a block's first store goes to DRAM only (counted); once it
    has been seen before, it is written through to NVMe. The CPU tier admits everything."""
    from kvtier.policies import ADMISSION
    bb = 2 * H * BT * D2 * 4
    cpu = SlotTier("cpu", 4, bb, EVICTION.get("lru")(4))
    nv = NvmeControl("nvme", str(tmp_path / "nvme"), 16, bb, EVICTION.get("lru")(16), {"model": "t"})
    s = scheduler([cpu, nv], BT, admission=[ADMISSION.get("all")(), ADMISSION.get("second_hit")()])
    w, c = worker(0)
    r = Req("a", list(range(4 * BT + 1)))
    ids = [1, 2, 3, 4, 5]
    s.lookup(r, 0)
    s.on_alloc(r, [ids], 0)
    step(s, w, [("a", r.num_tokens, ids)])
    s.on_finished("a")
    assert "store_planned_blocks.nvme" not in s.totals and cpu.num_resident == 4 and nv.num_resident == 0
    assert s.totals["not_admitted_blocks.nvme"] == 4 and "not_admitted_blocks.cpu" not in s.totals
    cpu.evict(list(cpu.iter_free_slots()))       # DRAM loses them; the same prefix comes back
    r2 = Req("b", r.tokens)
    assert s.lookup(r2, 0) == 0
    s.on_alloc(r2, [ids], 0)
    step(s, w, [("b", r2.num_tokens, ids)])
    assert s.totals["store_planned_blocks.nvme"] == 4 and len(nv.index) == 4
    assert s.totals["not_admitted_blocks.nvme"] == 4 and s.totals["stored_blocks.nvme"] == 4
    s.on_finished("b")
    assert s.pinned_blocks() == 0
    s.close()
    w.close()


def test_load_only_scheduler_still_names_the_nvme_dir(tmp_path):
    """With stores off (`store: off`), a step that only loads from NVMe still tells the worker
    where the data file is, so a fresh worker serves the restored blocks."""
    d = tmp_path / "nvme"
    r = Req("a", list(range(3 * BT + 1)))
    s, cpu, nv = sched(d)
    w, c = worker(0)
    s.lookup(r, 0)
    s.on_alloc(r, [[1, 2, 3, 4]], 0)
    step(s, w, [("a", r.num_tokens, [1, 2, 3, 4])])
    want = [torch.cat([c[n][b].reshape(-1).view(torch.uint8) for n in c]) for b in (1, 2, 3)]
    s.close()
    w.close()

    bb = 2 * H * BT * D2 * 4
    cpu = SlotTier("cpu", 8, bb, EVICTION.get("lru")(8))
    nv = NvmeControl("nvme", str(d), 16, bb, EVICTION.get("lru")(16), {"model": "t"})
    s = scheduler([cpu, nv], BT, store=False)
    w, c = worker(1)
    r2 = Req("b", r.tokens)
    assert s.lookup(r2, 0) == 3 * BT
    s.on_alloc(r2, [[9, 10, 11, 12]], 3 * BT)
    meta = step(s, w, [("b", r2.num_tokens, [9, 10, 11, 12])])
    assert meta.nvme_dir == nv.dir and not meta.stores
    assert w.take_load_errors() == set() and w.totals["blocks_loaded.nvme"] == 3
    got = [torch.cat([c[n][b].reshape(-1).view(torch.uint8) for n in c]) for b in (9, 10, 11)]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    s.on_finished("b")
    s.close()
    w.close()


def _ranks_step(s, ws, scheduled):
    """One step with several workers: each gets its own copy of the metadata (as over vLLM's RPC)
    and their reports are aggregated the way vLLM's KVOutputAggregator does."""
    import copy
    meta = s.build_meta([(q, n, None if ids is None else [ids]) for q, n, ids in scheduled])
    agg = None
    for w in ws:
        w.bind(copy.deepcopy(meta))
        w.start_load()
        w.save()
        m = w.take_report()
        if m is not None:
            agg = m if agg is None else agg.aggregate(m)
    s.on_worker_meta(agg)
    return meta


def _rank_workers(seeds):
    return [worker(seed, rank=rank) for rank, seed in enumerate(seeds)]


def _shards(c, blocks):
    return [torch.cat([c[n][b].reshape(-1).view(torch.uint8) for n in c]) for b in blocks]


def test_two_ranks_each_write_and_verify_their_own_shard(tmp_path):
    """Tensor parallel: every rank writes its shard of each block into its own file (data.<rank>)
    with its own checksum; the index keeps one checksum per rank; after a restart each rank reads
    back its own shard byte-exact; a shard flipped on one rank's disk is a miss for the block."""
    d = tmp_path / "nvme"
    r = Req("a", list(range(4 * BT + 3)))
    ids = [1, 2, 3, 4, 5]
    s, cpu, nv = sched(d, ranks=2)
    ws = _rank_workers([0, 1])
    s.lookup(r, 0)
    s.on_alloc(r, [ids], 0)
    _ranks_step(s, [w for w, _ in ws], [("a", r.num_tokens, ids)])
    assert nv.num_resident == 4 and len(nv.index) == 4
    entries = [e for _, e in nv.index.items()]
    assert all(len(e.rank_sums) == 2 and e.rank_sums[0] != e.rank_sums[1] for e in entries)
    assert os.path.getsize(d / "data.0") == os.path.getsize(d / "data.1") > 0
    want = [_shards(c, ids[:4]) for _, c in ws]
    s.close()
    for w, _ in ws:
        w.close()

    # restart: both ranks load from NVMe (empty CPU tier, other GPU contents), each its own shard
    s, cpu, nv = sched(d, ranks=2)
    ws = _rank_workers([2, 3])
    assert nv.restored_blocks == 4
    r2 = Req("b", r.tokens)
    assert s.lookup(r2, 0) == 4 * BT
    dst = [9, 10, 11, 12, 13]
    s.on_alloc(r2, [dst], 4 * BT)
    _ranks_step(s, [w for w, _ in ws], [("b", r2.num_tokens, dst)])
    for (w, c), shard in zip(ws, want):
        assert all(torch.equal(a, b) for a, b in zip(_shards(c, dst[:4]), shard))
        assert w.take_load_errors() == set() and w.corrupt_blocks == 0
    s.on_finished("b")
    s.close()
    for w, _ in ws:
        w.close()

    # rank 1's copy of block 2 flipped on its disk: rank 1 fails it, the block leaves the index
    s, cpu, nv = sched(d, ranks=2)
    ws = _rank_workers([4, 5])
    r3 = Req("c", r.tokens)
    s._track(r3)
    slot = nv.find(s._reqs["c"].keys[2])
    with open(d / "data.1", "r+b") as f:
        f.seek(slot * nv.stride + 11)
        f.write(b"\x00\xff\x00")
    assert s.lookup(r3, 0) == 4 * BT
    s.on_alloc(r3, [dst], 4 * BT)
    _ranks_step(s, [w for w, _ in ws], [("c", r3.num_tokens, dst)])
    assert ws[0][0].take_load_errors() == set() and ws[1][0].take_load_errors() == {dst[2]}
    assert s.totals["corrupt_blocks.nvme"] == 1 and len(nv.index) == 3
    s.on_finished("c")
    assert s.pinned_blocks() == 0
    s.close()
    for w, _ in ws:
        w.close()


def test_ranks_writing_behind_commit_once_every_rank_reported(tmp_path):
    """Ranks report their NVMe writes in different steps (write-behind on their own clocks): the
    block is committed only when the last rank's report is in, with both checksums."""
    s, cpu, nv = sched(tmp_path / "nvme", ranks=2)
    (w0, _), (w1, _) = _rank_workers([0, 1])
    r = Req("a", list(range(2 * BT + 1)))
    s.lookup(r, 0)
    s.on_alloc(r, [[1, 2, 3]], 0)
    import copy
    meta = s.build_meta([("a", r.num_tokens, [[1, 2, 3]])])
    m1 = copy.deepcopy(meta)
    for w, m in ((w0, meta), (w1, m1)):
        w.bind(m)
        w.start_load()
        w.save()
    from kvtier.connector.metadata import KVTierWorkerMeta
    m0, m1 = w0.take_report(), w1.take_report()
    late = KVTierWorkerMeta(rank=1, copied=m1.copied)   # rank 1's NVMe report comes later
    m1.copied = {}
    s.on_worker_meta(m0.aggregate(m1))                     # this step: CPU stores of both, NVMe of rank 0
    assert len(nv.index) == 0 and nv.num_resident == 0 and cpu.num_resident == 2
    assert s.pinned_blocks() == 4    # 2 CPU sources pinned and 2 NVMe slots pending until every rank reported
    s.on_worker_meta(late)                                 # a later step: rank 1's NVMe report
    assert len(nv.index) == 2 and nv.num_resident == 2
    assert all(len(e.rank_sums) == 2 for _, e in nv.index.items())
    assert s.totals["stored_blocks.nvme"] == 2 and s.pinned_blocks() == 0
    s.close()
    w0.close()
    w1.close()
