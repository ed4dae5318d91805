"""Blocks a store still reads are never rewritten under it (issue 35 item 1, issue 36 item 1), on
CPU with `probes.DeferredStreams` (copies run only when something lets them, as a GPU's run
later): the scheduler side and the worker driven through the connector's own hooks in vLLM's
orders. No store makes the compute stream wait; instead a preempted request's blocks, and any
block vLLM allocates again, are named in the next step's metadata (`settle`) and the worker waits
on the host for the stores still reading them in `handle_preemptions`, before the forward or
another connector (NIXL, an offloader, on its own stream) writes them. So a block rewritten after
its request was preempted is never stored under the old key; a steady state of running requests
makes neither the compute stream nor the host wait."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput

from kvtier.connector.worker import KVTierWorker
from kvtier.policies import EVICTION
from kvtier.tiers.base import SlotTier

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"))
from parts_util import scheduler, worker_settings  # noqa: E402
from test_connector_scheduler import BT, Req  # noqa: E402
from test_deferred_stores import CountingStreams, canonical_rows  # noqa: E402
from test_held_requests import Conn  # noqa: E402
from test_kv_layout import flash_caches  # noqa: E402

NB = 24
SLOTS = 32
ORDERS = ["v2", "v1", "no-forward"]


class Engine:
    """One scheduler and one worker (its hooks: `test_held_requests.Conn`) stepping as vLLM does."""

    def __init__(self, prefer: str = "side") -> None:
        self.st = CountingStreams(prefer)
        self.caches = flash_caches(blocks=NB)
        w = KVTierWorker(worker_settings(SLOTS), copy_streams=self.st)
        w.register_kv_caches(self.caches)
        self.w, self.c = w, Conn(w)
        self.sched = scheduler([SlotTier("cpu", SLOTS, w.layout.block_bytes, EVICTION.get("lru")(SLOTS))], BT,
                               hold_stores=True)
        self.stored: dict[int, list[bool]] = {}
        self.slots: dict[int, list[int]] = {}

    def step(self, meta, order: str = "v2", forward=None, other=None):
        """One step of the worker in vLLM's `order` ("v2": the GPU model runner's `pre_forward`;
        "v1": `execute_model`, before the state update; "no-forward": a step without tokens, no
        `handle_preemptions`), then the scheduler's update. `forward()`: the forward's writes
        (queued on the compute stream); `other()`: another connector's writes on its own stream,
        started in its `start_load_kv` (here: now, ordered with nothing)."""
        c = self.c
        for op in meta.stores:
            self.slots[op.op_id] = list(op.slots)
        if order != "no-forward":
            c.handle_preemptions(meta)
        c.bind_connector_metadata(meta)
        if other is not None:
            other()
        c.start_load_kv(None)
        if forward is not None:
            forward()
        c.wait_for_save()
        r = c.get_transfer_results(set())
        rep = c.build_connector_worker_meta()
        c.clear_connector_metadata()
        self.sched.on_output(KVConnectorOutput(finished_sending=r.finished_sending or None,
                                               kv_connector_worker_meta=rep))
        self.stored.update(rep.stored if rep is not None else {})
        return rep

    def rows(self, op_id: int) -> list[torch.Tensor]:
        buf = self.w.pools[0].buffer.view(SLOTS, -1)
        return [buf[s].clone() for s in self.slots[op_id]]

    def settle_all(self) -> None:
        """The device catches up; the next steps report what completed."""
        self.st.drain()
        self.step(self.sched.build_meta([]))


def running(e: Engine, rid: str, ids: list[int], base: int) -> tuple[Req, int]:
    """A request of `len(ids) - 1` full blocks computed in one step: one store queued; its op id."""
    q = Req(rid, list(range(base, base + (len(ids) - 1) * BT + 1)))
    e.sched.lookup(q, 0)
    e.sched.on_alloc(q, [ids], 0)
    meta = e.sched.build_meta([(rid, q.num_tokens, [ids])])
    assert len(meta.stores) == 1 and meta.stores[0].block_ids == ids[:-1]
    op = meta.stores[0].op_id
    e.step(meta)
    return q, op


def preempted(e: Engine, *rids: str):
    so = SchedulerOutput.make_empty()
    so.preempted_req_ids = set(rids)
    return e.sched.on_step(so)


def fill(t: torch.Tensor, value: float):
    return lambda: t.fill_(value)


@pytest.mark.parametrize("order", ORDERS)
def test_a_preempted_requests_block_rewritten_off_the_compute_stream_is_never_stored_under_its_old_key(order):
    """vLLM preempts the request while its store still copies and frees its blocks at once;
    another connector writes one of them on its own stream in the next step. The store is
    settled first: stored with the forward's bytes, never the new ones."""
    e = Engine()
    ids = [1, 2, 3, 4]
    _, op = running(e, "a", ids, 100)
    want = canonical_rows(e.caches, ids[:3])
    assert op not in e.stored                         # still copying (the device has not run it)
    meta = preempted(e, "a")
    named = set(getattr(meta, "settle", ()))
    layers = list(e.caches.values())
    e.step(meta, order, other=lambda: [t[2].fill_(7.0) for t in layers])
    e.settle_all()
    assert e.stored.get(op) == [True] * 3
    assert all(torch.equal(a, b) for a, b in zip(e.rows(op), want))   # the forward's bytes, not 7.0
    assert set(ids) <= named                          # its blocks: settled before any reuse
    assert e.w.totals.get("store_settle_waits") == 1
    assert e.st.waited == []                          # the compute stream never waited on a store


@pytest.mark.parametrize("writer", ["forward", "other"])
def test_a_block_allocated_again_under_a_store_still_copying_is_settled_first(writer):
    """A block freed while a store still reads it (a held request released at the bound, a
    sliding window's block) and allocated to a new request: the new request's forward (the
    compute stream, which no longer waits on stores) or another connector writes it only after
    the store completed."""
    e = Engine(prefer="compute")                      # the compute stream runs first whenever it can
    _, op = running(e, "a", [1, 2, 3, 4], 100)
    want = canonical_rows(e.caches, [1, 2, 3])
    q = Req("b", list(range(500, 500 + 2 * BT + 1)))
    e.sched.lookup(q, 0)
    e.sched.on_alloc(q, [[2, 9, 10]], 0)             # block 2 again (vLLM freed it)
    meta = e.sched.build_meta([("b", q.num_tokens, [[2, 9, 10]])])
    named = set(getattr(meta, "settle", ()))
    layers = list(e.caches.values())
    write = lambda: [t[2].fill_(5.0) for t in layers]   # noqa: E731
    if writer == "forward":
        e.step(meta, forward=lambda: [e.st.compute(fill(t[2], 5.0)) for t in layers])
    else:
        e.step(meta, other=write)
    e.settle_all()
    assert e.stored.get(op) == [True] * 3
    assert all(torch.equal(a, b) for a, b in zip(e.rows(op), want))
    assert {2, 9, 10} <= named
    assert e.w.totals.get("store_settle_waits") == 1
    assert e.st.waited == []


def test_steady_state_stores_make_neither_the_compute_stream_nor_the_host_wait():
    """Four running requests, each computing a block a step into fresh blocks, stored as they
    fill: no store makes the compute stream wait, no hook waits on the host, no settle is asked
    for a block under a store, and every block is stored byte-exact."""
    e = Engine()
    reqs = {}
    for i in range(4):
        q = Req(f"r{i}", list(range(1000 * i, 1000 * i + 5 * BT + 1)))
        e.sched.lookup(q, 0)
        e.sched.on_alloc(q, [[1 + 5 * i]], 0)
        reqs[q.request_id] = (q, [1 + 5 * i])
    want: dict[int, list[torch.Tensor]] = {}
    for k in range(1, 5):
        if k == 1:
            meta = e.sched.build_meta([(rid, BT, [ids]) for rid, (_, ids) in reqs.items()])
        else:                                         # vLLM's output: one fresh block per request
            so = SchedulerOutput.make_empty()
            cr = so.scheduled_cached_reqs
            for rid, (_, ids) in reqs.items():
                ids.append(ids[-1] + 1)
                cr.req_ids.append(rid)
                cr.new_block_ids.append(([ids[-1]],))
                cr.num_computed_tokens.append((k - 1) * BT)
                so.num_scheduled_tokens[rid] = BT
            meta = e.sched.on_step(so)
        assert len(meta.stores) == 4
        for op in meta.stores:
            want[op.op_id] = canonical_rows(e.caches, op.block_ids)
        e.step(meta)
        e.st.drain()                                  # the device keeps up between steps
    e.step(e.sched.build_meta([]))
    assert sorted(e.stored) == sorted(want) and all(all(v) for v in e.stored.values())
    for op, rows in want.items():
        assert all(torch.equal(a, b) for a, b in zip(e.rows(op), rows))
    assert e.st.waited == []                          # the compute stream never waited on a store
    assert e.st.syncs == 0                            # nor the host


def test_a_finished_request_is_held_and_its_blocks_reused_only_after_its_store_byte_exact():
    """The delay-free path: a request finishing with a store in flight is held (vLLM keeps its
    blocks), released once the store ran; its blocks allocated again then need no wait."""
    e = Engine()
    _, op = running(e, "a", [1, 2, 3, 4], 100)
    want = canonical_rows(e.caches, [1, 2, 3])
    assert e.sched.on_finished("a", ([1, 2, 3, 4],)) == (True, None)
    meta = e.sched.build_meta([])
    assert getattr(meta, "settle", []) == []          # nothing freed: vLLM holds its blocks
    e.step(meta)
    e.st.drain()
    e.step(e.sched.build_meta([]))
    assert e.stored.get(op) == [True] * 3 and "a" not in e.sched.holds.held
    q = Req("b", list(range(700, 700 + 3 * BT + 1)))
    e.sched.lookup(q, 0)
    e.sched.on_alloc(q, [[1, 2, 3, 4]], 0)
    layers = list(e.caches.values())
    e.step(e.sched.build_meta([]), other=lambda: [t[1:4].fill_(3.0) for t in layers])
    assert all(torch.equal(a, b) for a, b in zip(e.rows(op), want))
    assert e.st.waited == []
    assert e.st.syncs == 0 and "store_settle_waits" not in e.w.totals


def test_a_settle_that_cannot_be_confirmed_commits_nothing():
    """The host's wait for a store under a preempted request's blocks fails (a device error):
    the store is dropped, reported not stored, never committed."""

    class FailingSync(CountingStreams):
        def sync(self, event):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        def query(self, event):
            return False

    e = Engine()
    e.st.__class__ = FailingSync
    _, op = running(e, "a", [1, 2, 3, 4], 100)
    e.step(preempted(e, "a"))
    assert e.stored.get(op) == [False] * 3
    assert e.w.totals["stores_dropped"] == 3
    assert not any(e.sched.ctrl.holds(k, 0) for k in e.sched._reqs["a"].keys)   # nothing committed
