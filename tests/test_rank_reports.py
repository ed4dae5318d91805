"""Stores under tensor (and pipeline) parallelism complete once every rank reported them (issue 35,
item 2): each rank copies a store into its own DRAM pool on its own clock and reports it in the step
its poll sees the copy done, so the ranks' reports of one store come in different steps. A store is
committed only when every rank reported it stored; any rank's failure aborts it; a rank that never
reports within the limit aborts it (counted, logged once). What depends on the store (a finished
request vLLM holds for it, the GPU blocks lazy offload pins for it) is released only then, never
while a rank may still be copying. Under MLA with tensor parallelism rank 0 alone writes the NVMe
shard: another rank's failed step cannot fail it.

The ranks' reports are aggregated per step as vLLM does (`Report.aggregate`; the workers' outputs
through vLLM's `KVOutputAggregator` in the held-request tests)."""

from __future__ import annotations

import logging
import os
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.connector.metadata import KVTierWorkerMeta
from kvtier.policies import EVICTION
from kvtier.tiers.base import SlotTier
from kvtier.tiers.gpu import BlockPoolContext

sys.path.insert(0, os.path.dirname(__file__))
from test_held_requests import Engine, FailLater, probes, start  # noqa: E402
from parts_util import scheduler, worker_settings  # noqa: E402
from test_connector_lazy import pool_with_hashed  # noqa: E402


def step_reports(s, reports):
    """One step's reports of several ranks, aggregated as vLLM does, into the scheduler."""
    agg = None
    for r in reports:
        agg = r if agg is None else agg.aggregate(r)
    s.on_worker_meta(agg)


@st.composite
def schedules(draw):
    """(ranks, the step each rank reports in, the rank that fails or None)."""
    n = draw(st.sampled_from([2, 4]))
    at = draw(st.lists(st.integers(0, n - 1), min_size=n, max_size=n))
    bad = draw(st.one_of(st.none(), st.integers(0, n - 1)))
    return n, at, bad


@settings(max_examples=60, deadline=None)
@given(schedules())
def test_a_lazy_store_commits_and_unpins_only_once_every_rank_reported(sched):
    """Lazy offload's store of 3 GPU blocks, reported by 2 or 4 ranks in any steps and orders, one
    rank maybe failing: not visible and its GPU blocks pinned until the last rank's report; then
    committed (all ok) or aborted (one failed), and unpinned either way."""
    n, at, bad = sched
    pool, hashed = pool_with_hashed(3)
    tier = SlotTier("cpu", 16, 64, EVICTION.get("lru")(16))
    s = scheduler([tier], 4, offload="lazy", max_blocks_per_step=8, ranks=n)
    s.bind_gpu(BlockPoolContext(pool))
    meta = s.build_meta([])
    (op,) = meta.stores
    ids = op.block_ids
    last = max(at)
    for t in range(last + 1):
        step_reports(s, [KVTierWorkerMeta(rank=r, stored={op.op_id: [r != bad] * len(ids)})
                         for r in range(n) if at[r] == t])
        if t < last:
            assert tier.num_resident == 0 and s.ctrl.inflight.stores == 1
            assert all(pool.blocks[i].ref_cnt == 1 for i in ids)      # a rank still copies from them
    assert s.ctrl.inflight.stores == 0
    assert all(pool.blocks[i].ref_cnt == 0 for i in ids)
    if bad is None:
        assert tier.num_resident == 3 and s.ctrl.total("store_failed_blocks.cpu") == 0
    else:
        assert tier.num_resident == 0 and s.ctrl.total("store_failed_blocks.cpu") == 3


@pytest.mark.parametrize("first", [0, 1])
def test_a_request_finishing_after_one_rank_reported_is_held_until_every_rank_did(first):
    """Two ranks, each its own copy: the request finishes after one rank reported its store and
    while the other still copies; it is held (vLLM keeps its GPU blocks) and the store is committed
    only once the second rank reported."""
    streams = [probes.DeferredStreams(), probes.DeferredStreams()]
    e = Engine(streams, ranks=2)
    start(e)
    streams[first].drain()
    e.step()                                        # one rank reported the store, the other copies
    assert e.tier.num_resident == 0
    assert e.finished("a") is True
    e.step()
    assert not any(e.sent)
    streams[1 - first].drain()
    e.step()
    assert e.tier.num_resident == 3
    e.step()
    assert [s for s in e.sent if s] == [{"a"}]
    assert not e.sched.holds.ops and not e.sched.has_pending_push_work()


@pytest.mark.parametrize("bad", [0, 1])
def test_any_ranks_failure_aborts_the_store_whenever_it_reports(bad):
    """One rank's copy fails, the other's completes, in different steps, the failure first or last:
    the store is aborted either way (nothing of it committed: a load would read a rank's stale
    shard) and the held request released once."""
    for bad_first in (True, False):
        streams = [probes.DeferredStreams(), probes.DeferredStreams()]
        streams[bad] = FailLater()
        e = Engine(streams, ranks=2)
        start(e)
        assert e.finished("a")
        for r in ([bad, 1 - bad] if bad_first else [1 - bad, bad]):
            if r == bad:
                streams[r].fail = True
            else:
                streams[r].drain()
            e.step()
        e.step()
        assert e.tier.num_resident == 0 and e.sched.ctrl.inflight.stores == 0, bad_first
        assert e.sched.ctrl.total("store_failed_blocks.cpu") == 3
        assert e.sched.ctrl.total("stored_blocks.cpu") == 0
        assert [s for s in e.sent if s] == [{"a"}]


def test_a_rank_that_never_reports_aborts_the_store_at_the_limit(caplog):
    """Rank 1 never reports: the store waits; past the limit it is aborted, counted, logged once,
    and what it held is released (lazy offload then plans those blocks again)."""
    now = [0.0]
    pool, hashed = pool_with_hashed(3)
    tier = SlotTier("cpu", 16, 64, EVICTION.get("lru")(16))
    s = scheduler([tier], 4, offload="lazy", max_blocks_per_step=8, ranks=2, clock=lambda: now[0])
    s.bind_gpu(BlockPoolContext(pool))
    (op,) = s.build_meta([]).stores
    step_reports(s, [KVTierWorkerMeta(rank=0, stored={op.op_id: [True] * 3})])
    now[0] = 59.0
    s.build_meta([])
    assert s.ctrl.inflight.stores == 1 and all(pool.blocks[i].ref_cnt == 1 for i in op.block_ids)
    now[0] = 61.0
    with caplog.at_level(logging.ERROR, logger="kvtier.core.controller"):
        s.build_meta([])
    assert s.ctrl.inflight.store_of(op.op_id) is None and tier.num_resident == 0
    assert s.ctrl.total("store_unreported_blocks.cpu") == 3
    assert op.op_id not in s.lazy.pinned          # its GPU blocks released (planned again: a new store)
    assert [r.getMessage() for r in caplog.records if "not reported by ranks [1]" in r.getMessage()] != []
    step_reports(s, [KVTierWorkerMeta(rank=1, stored={op.op_id: [True] * 3})])   # too late: ignored
    assert tier.num_resident == 0


def test_mla_a_non_writers_failed_step_cannot_fail_rank0s_nvme_write(tmp_path):
    """MLA, TP = 2: rank 1's step fails (its stores and copies reported failed) before rank 0's NVMe
    write is reported (written behind, a step later): rank 0's durable write is indexed; the DRAM
    store, which rank 1's pool lacks, is not committed."""
    from kvtier.connector.worker import KVTierWorker
    from test_connector_nvme import _ranks_step, caches, sched
    from test_connector_scheduler import BT, Req

    d = tmp_path / "nvme"
    s, cpu, nv = sched(d, ranks=1, reporters=2)   # what the connector builds under MLA: one shard, two ranks
    ws = []
    for rank in range(2):
        w = KVTierWorker(worker_settings(8, nvme_write_lag_steps=1), rank=rank, ranks=2, store_rank=0)
        w.register_kv_caches(caches(0))
        ws.append(w)
    ws[1].save = ws[1].fail_step_stores   # rank 1's wait_for_save fails (the hook's safe answer)
    r = Req("a", list(range(4 * BT + 3)))
    ids = [1, 2, 3, 4, 5]
    s.lookup(r, 0)
    s.on_alloc(r, [ids], 0)
    _ranks_step(s, ws, [("a", r.num_tokens, ids)])
    assert nv.num_resident == 0                   # rank 0's write is still behind
    for _ in range(3):
        _ranks_step(s, ws, [])
    assert nv.num_resident == 4 and s.ctrl.total("stored_blocks.nvme") == 4
    assert cpu.num_resident == 0 and s.ctrl.total("store_failed_blocks.cpu") == 4
    s.close()
    for w in ws:
        w.close()
