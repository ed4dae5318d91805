"""vLLM's delay-free protocol for stores still copying (`scheduler.StoreHolds`, `worker.SendingRequests`), on CPU with
`probes.DeferredStreams` (copies run only when the test lets them, as a GPU's run later): the
scheduler side and the worker side driven through the connector's own hooks, the workers' outputs
aggregated by vLLM's own `KVOutputAggregator`. A finished request with a store in flight is held
(`request_finished` -> True) and reported in `finished_sending` exactly once, after its copy ran
(or failed, or was dropped at shutdown, or after the bound); a request with nothing in flight,
or on the CPU backend (no deferral), is not held."""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput

import kvtier.connector.connector as C
from kvtier.connector.worker import KVTierWorker
from kvtier.policies import EVICTION
from kvtier.tiers.base import SlotTier

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"))
import probes  # noqa: E402
from parts_util import scheduler, worker_settings  # noqa: E402
from test_connector_scheduler import BT, Req  # noqa: E402
from test_kv_layout import flash_caches  # noqa: E402

NB = 12


class Conn(C.KVTierConnector):
    """The connector's hooks (their safe answers included) around one worker and, on rank 0, the scheduler: a `KVTierConnector` built
    without a vLLM config."""

    def __init__(self, worker, sched=None) -> None:
        self.worker, self.sched, self.hybrid = worker, sched, False

    def request_finished(self, req_id: str) -> bool:
        delay, _ = self.sched.on_finished(req_id)
        return delay


class FailLater(probes.DeferredStreams):
    """A store's event reports a device error once `fail` is set."""

    fail = False

    def query(self, event):
        if self.fail:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().query(event)


class Engine:
    """One scheduler and `ranks` workers stepping as vLLM does: the plan, each worker's hooks, the
    outputs aggregated over ranks (vLLM's aggregator, world size), the scheduler's update."""

    def __init__(self, streams, ranks: int = 1, hold: bool = True) -> None:
        self.streams = streams
        self.workers = []
        for rank in range(ranks):
            w = KVTierWorker(worker_settings(16), rank=rank, ranks=ranks, copy_streams=streams[rank])
            w.register_kv_caches(flash_caches(blocks=NB))
            self.workers.append(Conn(w))
        tier = SlotTier("cpu", 16, self.workers[0].worker.layout.block_bytes, EVICTION.get("lru")(16))
        self.tier = tier
        self.sched = scheduler([tier], BT, hold_stores=hold, ranks=ranks)
        self.agg = KVOutputAggregator(ranks)
        self.sent: list[set[str]] = []        # finished_sending vLLM saw, per step

    def step(self, scheduled=()) -> list:
        """One step; returns the stores it planned."""
        meta = self.sched.build_meta(list(scheduled))
        planned = list(meta.stores)
        outs = []
        for c in self.workers:
            c.worker.bind(copy.deepcopy(meta))         # each worker process receives its own copy
            c.start_load_kv(None)
            c.wait_for_save()
            r = c.get_transfer_results(set())
            kv = KVConnectorOutput(finished_sending=r.finished_sending or None,
                                   kv_connector_worker_meta=c.build_connector_worker_meta())
            c.worker.bind(None)
            out = copy.copy(EMPTY_MODEL_RUNNER_OUTPUT)   # each rank's own (they cross processes in vLLM)
            out.kv_connector_output = kv
            outs.append(out)
        out = self.agg.aggregate(outs).kv_connector_output
        self.sched.on_output(out)
        self.sent.append(set(out.finished_sending or ()))
        return planned

    def finished(self, rid: str) -> bool:
        delay, _ = self.sched.on_finished(rid)
        return delay


def start(e: Engine, rid: str = "a", base: int = 1) -> Req:
    """A request of three full blocks computed in one step: one store of its blocks queued."""
    q = Req(rid, list(range(base * 100, base * 100 + 3 * BT + 1)))
    ids = list(range(base, base + 4))
    e.sched.lookup(q, 0)
    e.sched.on_alloc(q, [ids], 0)
    stores = e.step([(rid, q.num_tokens, [ids])])
    assert len(stores) == 1 and stores[0].block_ids == ids[:3]
    return q


def test_a_finished_request_is_held_until_its_store_copied_and_released_once():
    st = probes.DeferredStreams()
    e = Engine([st])
    start(e)
    assert e.finished("a") is True                 # its store has not run: vLLM keeps the blocks
    assert e.sched.has_pending_push_work()         # vLLM keeps stepping to hear about it
    for _ in range(3):
        e.step()                                   # the device has not run the copy
    assert not any(e.sent)
    st.drain()                                     # now it has
    e.step()
    assert e.sent[-1] == {"a"}
    for _ in range(3):
        e.step()
    assert [s for s in e.sent if s] == [{"a"}]     # exactly once
    assert not e.sched.has_pending_push_work()
    assert e.workers[0].worker.totals["blocks_stored.cpu"] == 3


def test_the_request_is_named_only_after_the_store_is_reported():
    """The store's report and the release come in the same step: the scheduler commits the
    blocks before vLLM frees them (never a release before the store's event completed)."""
    st = probes.DeferredStreams()
    e = Engine([st])
    start(e)
    assert e.finished("a")
    e.step()
    st.drain()
    e.step()
    assert e.sent == [set(), set(), {"a"}]         # the start step, a step still copying, the release
    assert not e.sched.holds.ops and not e.sched.holds.held


def test_a_failed_store_releases_its_request():
    st = FailLater()
    e = Engine([st])
    start(e)
    assert e.finished("a")
    e.step()
    st.fail = True                                  # the copy's event reports a device error
    e.step()
    assert e.sent[-1] == {"a"}
    assert e.workers[0].worker.totals["store_copy_failed"] == 1
    e.step()
    assert [s for s in e.sent if s] == [{"a"}]


def test_a_request_with_no_store_in_flight_is_not_held():
    st = probes.DeferredStreams()
    e = Engine([st])
    start(e)
    st.drain()
    e.step()                                        # its store is reported before it finishes
    assert e.finished("a") is False
    e.sched.lookup(Req("b", [1, 2]), 0)             # no full block: nothing stored
    assert e.finished("b") is False
    e.step()
    assert not any(e.sent) and not e.sched.has_pending_push_work()


def test_the_cpu_backend_never_holds():
    """Without deferral (`hold_stores` False, what the CPU backend's scheduler side runs) a
    request is never held, whatever its stores."""
    e = Engine([probes.DeferredStreams()], hold=False)
    start(e)
    assert e.finished("a") is False
    e.step()
    assert not any(e.sent)


def test_shutdown_drain_and_the_bound_release_held_requests():
    st = probes.DeferredStreams()
    e = Engine([st])
    start(e, "a", 1)
    start(e, "b", 5)
    assert e.finished("a") and e.finished("b")
    w = e.workers[0].worker
    w.sending.limit_s = 0.0                         # the bound: released though still copying, counted
    e.step()
    assert e.sent[-1] == {"a", "b"} and w.totals["held_release_timeouts"] == 2
    start(e, "c", 9)
    assert e.finished("c")
    w.sending.limit_s = 1e9
    e.step()
    assert not e.sent[-1]
    w.close(timeout_s=0.05)                         # never completes: dropped at shutdown
    assert w.totals["stores_dropped"] == 9            # a, b and c: three blocks each
    r = e.workers[0].get_transfer_results(set())
    assert r.finished_sending == {"c"}


def test_under_tensor_parallelism_vllm_frees_the_request_once_after_every_rank_copied():
    """Two ranks, each its own copies: vLLM's aggregator (world size 2) names the request once,
    in the step where the slower rank's copy completed."""
    sa, sb = probes.DeferredStreams(), probes.DeferredStreams()
    e = Engine([sa, sb], ranks=2)
    start(e)
    assert e.finished("a")
    sa.drain()
    e.step()
    e.step()
    assert not any(e.sent)                          # rank 1 still copies
    sb.drain()
    e.step()
    e.step()
    assert [s for s in e.sent if s] == [{"a"}]


def test_a_failed_transfer_hook_releases_every_held_request(monkeypatch):
    st = probes.DeferredStreams()
    e = Engine([st])
    start(e)
    assert e.finished("a")
    c = e.workers[0]
    c.worker.bind(e.sched.build_meta([]))
    monkeypatch.setattr(c.worker, "poll_async", lambda: 1 / 0)
    r = c.get_transfer_results(set())
    assert r.finished_sending == {"a"} and c.worker.totals["hook_errors.get_transfer_results"] == 1

