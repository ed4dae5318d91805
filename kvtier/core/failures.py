"""The executor's failures (a part of `kvtier.core.executor.Executor`): the safe answer when a
load or a store cannot run. A load that fails anywhere (read, verify, staging, queuing its copy,
the layer's wait) is a load error for exactly the blocks of the requests it touched (vLLM
recomputes them) and taints the step: the step's forward read those blocks, so nothing it
computed is stored (`tainted`, until the next `begin_step`, whatever order vLLM takes the load
errors and the stores in)."""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

from kvtier.tiers.once import cause
from kvtier.core.plan import CopyOp, LoadOp, StoreOp
from kvtier.tiers.counters import Metric


class Failures:
    """Mixed into `Executor`: works on its state (`_load_done`, `_load_errors`...); outcomes go to
    its `report` (`kvtier.core.plan.ReportBuilder`)."""

    def _queue(self, jobs: list[tuple[int, Any]], layered: bool) -> list | None:
        """Queue (a layered outside) or run these copies into the outside; when that fails, each
        request's copies again on their own, so that exactly the requests whose copies fail get
        load errors. Returns the layer events covering every copy queued."""
        t1 = time.perf_counter()
        try:
            return self._queue_once([j for _, j in jobs], layered)
        except Exception as e:  # noqa: BLE001 - retried per request below
            self.once(("load_copies",) + cause(e), logging.ERROR, "kvtier: copying %d loads into the KV failed: "
                       "%s (each request's copies retried on their own; those that fail again are load "
                       "errors)", len(jobs), e)
            self._count(Metric.LOAD_COPY_FAILED.key)
            by_op: dict[int, list] = {}
            for at, j in jobs:
                by_op.setdefault(at, []).append(j)
            events = None
            for at, js in by_op.items():
                try:
                    events = self._queue_once(js, layered) or events  # the side stream runs them in order
                except Exception as e2:  # noqa: BLE001 - this request's blocks are load errors
                    self._copy_failed(at, e2)
            return events
        finally:
            self._copy_s += time.perf_counter() - t1

    def _copy_failed(self, at: int, e: BaseException) -> None:
        op, name, oks = self._load_done[at]
        self.once(("load_copy", name) + cause(e), logging.ERROR, "kvtier: copying %d blocks of %s into the KV "
                   "failed: %s (load errors, recomputed)", len(oks), op.req_id, e)
        self._load_done[at] = (op, name, [False] * len(oks))

    def _fail_pending(self, ops: Sequence[LoadOp]) -> None:
        """`load` failed part-way: every block of `ops` is a load error, whatever ran."""
        listed = {id(op) for op, _, _ in self._load_done}
        self._load_done = [(op, name, [False] * len(oks)) for op, name, oks in self._load_done]
        for op in ops:
            if id(op) in listed:
                continue
            self._load_done.append((op, self.name(op.tier), [False] * len(op.slots)))
            if op.via:
                self.report.not_stored(op.op_id, len(op.slots), unless_reported=True)

    def abandon_loads(self) -> None:
        """The pending loads' copies cannot be confirmed (the host could not wait for them): their
        blocks are load errors."""
        self._load_event = None
        self.layer_events = None
        self._load_done = [(op, name, [False] * len(oks)) for op, name, oks in self._load_done]
        self.finish_loads()

    def begin_step(self) -> None:
        """A new step: no load of it has failed yet (`tainted`)."""
        self.tainted = False

    def _add_errors(self, block_ids: Sequence[int]) -> None:
        """Load errors (reported by `take_load_errors`). Unless they come from an asynchronous load
        (copied after the forward), they taint the step: its forward read those blocks, so what it
        computed after them is stale and its stores are dropped (`tainted`, kept until the next
        `begin_step` whatever order vLLM takes the errors and the stores in)."""
        self._load_errors.update(block_ids)
        if not self._polling:
            self.tainted = True

    # ---- failures: the safe answer when work cannot run ----------------------------------------
    def fail_blocks(self, req_id: str, block_ids: Sequence[int], why: str, waiting: bool = False) -> None:
        """These blocks of the request were not loaded: load errors (the caller recomputes them).
        `waiting`: the request waits for an asynchronous load, so it is also reported as done."""
        ids = list(block_ids)
        if waiting:  # not run this step: no taint
            self._recv_failed.add(req_id)
            self._load_errors.update(ids)
        else:
            self._add_errors(ids)
        self.report.loaded(req_id, False)
        self._count(Metric.BLOCKS_LOAD_FAILED.key, len(ids))
        self.once(("load_failed", why), logging.WARNING,
                   "kvtier: %d blocks of %s not loaded (%s): reported as load errors, recomputed", len(ids), req_id,
                   why)

    def unread(self, op: LoadOp, oks: Sequence[bool]) -> None:
        """Report the blocks of `op` not loaded (`oks` False), whatever the reason: the controller
        remembers them (`kvtier.core.failed_loads`). A shared-tier block (slot -1) by its key."""
        ids = op.keys if op.slots and op.slots[0] < 0 and op.keys else op.slots
        self.report.unread(op.tier, [x for x, ok in zip(ids, oks) if not ok])

    def fail_loads_of(self, ops: Sequence[LoadOp], why: str, async_ids: Sequence[str] = ()) -> None:
        """These loads cannot run: each block a load error; a request loading asynchronously is
        also reported as done (with its errors), or it would wait forever."""
        self._recv_failed.update(async_ids)
        for op in ops:
            self.fail_blocks(op.req_id, op.block_ids, why)
            self.unread(op, [False] * len(op.slots))
            if op.via:  # a promotion read through DRAM slots: those slots were not written
                self.report.not_stored(op.op_id, len(op.slots))
            self._fetched.pop(id(op), None)
            if op.req_id in self._async:
                self._recv_failed.add(op.req_id)

    def fail_async(self) -> set[str]:
        """Every asynchronous load still waiting fails; returns the requests to report as done."""
        polling, self._polling = self._polling, True
        try:
            for ops in list(self._async.values()):
                self.fail_loads_of(ops, "the asynchronous load failed")
        finally:
            self._polling = polling
        self._recv_failed.update(self._async)
        self._async.clear()
        out, self._recv_failed = self._recv_failed, set()
        self._failed_done |= out
        return out

    def fail_stores(self, stores: Sequence[StoreOp], copies: Sequence[CopyOp]) -> None:
        """These stores and copies cannot run: dropped (future misses), their slots released."""
        n = 0
        for op in stores:
            n += self.report.not_stored(op.op_id, len(op.slots), unless_reported=True)
        for op in copies:
            self.report.copied(op.op_id, [-1] * len(op.src_slots))
            n += len(op.src_slots)
        self._count(Metric.BLOCKS_STORE_DROPPED.key, n)
