"""The data plane: one executor runs a controller's plan (`kvtier.core.plan`) and reports back.

The CLI, replay with data and the vLLM connector's workers all run this class; they differ only
in the *outside* (where blocks live outside the tiers) and how often they report:

- `Buffers`: a caller's tensors, one per block (the CLI's spill / restore / bench, replay);
- `kvtier.connector.kv_layout.KVCopier`: vLLM's KV cache (gather / scatter, on a GPU on a side
  stream ordered against the forward, one event per layer).

Each tier's data plane (`kvtier.tiers.contract.DataPlane`, looked up in `kvtier.core.handlers.Planes`)
declares its medium; an op is run by the handler of its (source medium, destination medium), one
of each class of `kvtier.core.handlers.HANDLERS`, built from the executor's parts (`Handlers`): a
load is (tier, OUTSIDE), a store (OUTSIDE, tier), a copy down (tier, tier), the last written
behind the step (`kvtier.core.handlers.CopiesDown`). A store into a data file (a stack with no
DRAM tier above NVMe) is written, flushed and reported within the call; with an engine that writes
device memory (kvikio) its payload goes device staging rows -> file (`kvtier.core.handlers.FileStore`).

Every failure is a per-block result (a miss, a load error the caller recomputes, a store not
committed), logged once per cause and counted; nothing here raises into the caller's step.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

from kvtier.core.handlers import Handlers, LoadRun, run_copies
from kvtier.core.handlers import Planes
from kvtier.common.once import Once, cause
from kvtier.core.plan import CopyOp, Counters, LoadOp, Plan, Report, ReportBuilder, StoreOp
from kvtier.core.staging import Staging
from kvtier.core.handlers import CopiesDown
from kvtier.core.outside import Outside
from kvtier.tiers.contract import DataPlane, Medium
from kvtier.tiers.io_engine import fault_point
from kvtier.common.counters import Metric

log = logging.getLogger("kvtier.executor")


class Executor:
    """Runs plans over the tiers' data planes (`planes[i]`: tier i's CpuPool, NvmeData or
    SharedData, or None where this process has none) and an outside.

    `write_lag_steps`: copies down are reported at most this many `step()`s after they were
    queued (0: in the same call). `tier_names` name the counters (`bytes_loaded.<tier>`...).
    `count`: count into another object's counters (a controller's, a worker's) instead of its own
    (`counters`). The executor owns its parts (`planes`, `report`, `down`, `handlers`) and
    dispatches each op to its handler; its failures are its own (a load error, a store dropped).
    """

    LOAD_CHUNK_BYTES = 8 << 20   # copies of lower-tier loads run per chunk read (copies on the caller)

    def __init__(self, outside: Outside | None, planes: Sequence[DataPlane | None], block_bytes: int, *,
                 tier_names: Sequence[str] = (), write_lag_steps: int = 0, rank: int = 0,
                 staging: Staging | None = None, report_cls: type[Report] = Report,
                 count: Callable[..., None] | None = None) -> None:
        self.outside = outside
        self.planes = Planes(planes, block_bytes, tier_names)
        self.block_bytes = block_bytes
        self.rank = rank
        self.staging = staging
        self.report = ReportBuilder(rank, report_cls)   # this step's report, built by every part
        self.counters = Counters()
        # where this executor and its parts count: its own counters, or another object's (`count`)
        self.count: Callable[..., None] = count if count is not None else self.counters.count
        self.once = Once(log)
        self._load_errors: set[int] = set()
        self.tainted = False                       # a load the step's forward reads failed (`begin_step`)
        self._polling = False                      # in poll_async / fail_async: failures do not taint
        self.down = CopiesDown(self.planes, self.report, self.count, self.once, write_lag_steps)  # written behind
        self.handlers = self._handlers()
        self.steps = 0
        self._async: dict[str, list[LoadOp]] = {}  # request -> its load ops, loading asynchronously
        self._recv_failed: set[str] = set()         # asynchronous loads that failed: reported as done
        self._failed_done: set[str] = set()         # ... and once reported, kept for `take_failed_recving`
        self._fetched: dict[int, tuple] = {}       # id(op) -> (host rows, rows, buffers, handle): read ahead
        self._load_event = None
        self._rows_event = None                    # accounted loads' last copies, maybe still reading host rows
        self.deferred: tuple | None = None         # the last `store(defer=True)`: (planned, event, t0)
        self.layer_events: list | None = None     # a layered load's events, one per layer
        self._load_done: list[tuple[LoadOp, str, list[bool]]] = []
        self._sync_s = self._copy_s = 0.0

    # ---- media -------------------------------------------------------------------------------
    def bind(self, outside: Outside | None = None, tier_names: Sequence[str] | None = None,
             planes: dict[int, DataPlane | None] | None = None, ntiers: int = 0) -> None:
        """Where blocks live outside (when given), the tiers' names (when given), and tiers' data
        planes in this process by index (None: none here); `ntiers`: room for that many."""
        self.planes.bind(tier_names, planes, ntiers)
        if outside is not None:
            self.outside = outside
            self.handlers = self._handlers()

    def _handlers(self) -> Handlers:
        """The handler of each medium pair, built from this executor's parts."""
        return Handlers(self.planes, self.outside, self.report, self.staging, self.count, self.once,
                        self.down.writes, self.down.puts)

    def name(self, tier: int) -> str:
        return self.planes.name(tier)

    # ---- loads -------------------------------------------------------------------------------
    def load(self, ops: Sequence[LoadOp], layered: bool = False) -> None:
        """Run loads: tier -> outside. `layered`: a layered outside enqueues the copies and leaves
        one event per layer in `layer_events`; others copy now (a lower tier's blocks chunk by chunk
        as their reads land). Results are reported by `finish_loads` (at once unless `layered`).
        Nothing raises: a failure anywhere (read, verify, staging, queuing a copy) makes the blocks
        of the requests it touched load errors."""
        if not ops:
            return
        self.finish_loads()  # the last copies may still read the staging rows handed out again here
        self.settle_rows(ops)
        try:
            self._load(ops, layered)
        except Exception as e:  # noqa: BLE001 - a failed load is a load error, never a raise
            self.once(("load_call",) + cause(e), logging.ERROR, "kvtier: loading %d ops failed: %s (their "
                       "blocks are load errors, recomputed)", len(ops), e)
            self._fail_pending(ops)
        if not layered:
            self.finish_loads()

    def _load(self, ops: Sequence[LoadOp], layered: bool) -> None:
        t0 = time.perf_counter()
        self._copy_s = 0.0
        copy_now = not (layered and self.outside.layered)
        jobs: list[tuple[int, Any]] = []   # (index of its op in _load_done, the copy)
        rows_of = [self._staging_of(op) for op in ops]   # before the loads: a read-ahead op leaves _fetched
        staged = sum(len(op.slots) for op, w in zip(ops, rows_of) if w == "host")
        dstaged = sum(len(op.slots) for op, w in zip(ops, rows_of) if w == "device")
        run = LoadRun(jobs, self.staging.views(staged) if staged else [], copy_now, self.LOAD_CHUNK_BYTES,
                      self.outside.device_staging.views(dstaged) if dstaged else [])
        for op, where in zip(ops, rows_of):
            name = self.name(op.tier)
            oks = [False] * len(op.slots)
            at = len(self._load_done)
            try:
                plane = self.planes.plane_of(op.tier)
                if op.via:
                    self.planes.host_pool(op.via_tier, op.via)
                oks = self.handlers.of(plane.medium, Medium.OUTSIDE).load(op, plane, run, at,
                                                                         self._fetched.pop(id(op), None))
            except Exception as e:  # noqa: BLE001 - a failed load is a load error, never a raise
                self.once(("load", name) + cause(e), logging.WARNING,
                           "kvtier: load of %d blocks for %s from %s failed: %s (recomputed)",
                           len(op.slots), op.req_id, name, e)
                if op.via:
                    self.report.not_stored(op.op_id, len(op.slots))
            if where == "host":
                run.row0 += len(op.slots)
            elif where == "device":
                run.drow0 += len(op.slots)
            self._load_done.append((op, name, oks))
        self._copy_s += run.copy_s   # copies run chunk by chunk as reads landed
        if jobs and not copy_now:
            self._sync_s = time.perf_counter() - t0   # reads + checksums, before the copies run
            self.layer_events = self._queue(jobs, layered=True)
            self._load_event = self.layer_events[-1] if self.layer_events else None
            return
        if jobs:
            self._queue(jobs, layered=False)
        self._sync_s = time.perf_counter() - t0 - self._copy_s

    def _queue_once(self, jobs: list, layered: bool) -> list | None:
        if layered:
            fault_point("load_copy")
            return self.outside.load_layered(jobs)
        run_copies(self.outside, jobs)
        return None

    @property
    def loads_pending(self) -> bool:
        """Loads whose copies are queued or whose results `finish_loads` has not taken yet."""
        return bool(self._load_done) or self._load_event is not None

    def _staging_of(self, op: LoadOp) -> str | None:
        """Where the op's reads land when it has no promotion slot nor a read ahead: the host's
        staging rows ("host"), the outside's device staging rows ("device": GPUDirect Storage), or
        no staging (None)."""
        h = self._handler_of(op.tier, Medium.OUTSIDE)
        if h is None or not h.stages or id(op) in self._fetched:
            return None
        if h.device_staged(op, self.planes.get(op.tier)):
            return "device"
        return "host" if not op.via and not self.outside.direct_reads else None

    def _handler_of(self, tier: int, dst: Medium) -> Any:
        """The handler that moves tier `tier`'s blocks to `dst`, None when there is no plane or handler."""
        p = self.planes.get(tier)
        return None if p is None else self.handlers.get(p.medium, dst)

    def finish_loads(self, wait: bool = True) -> None:
        """Wait (the host) for the last load's copies; account them; a copy that failed, or that
        cannot be confirmed, makes its blocks load errors. `wait=False` (a step's hooks): copies
        still running are accounted as queued (a device copy that fails later is a device error)
        and the host rows they read are handed out again only after them (`settle_rows`)."""
        ev, self._load_event = self._load_event, None
        failed = None
        if ev is not None and not wait and not self.outside.done(ev):
            self._rows_event, ev = ev, None
        if ev is not None:
            try:
                self.outside.sync(ev)
            except Exception as e:  # noqa: BLE001 - a failed device copy
                failed = e
                self.once(("layer_copies",) + cause(e), logging.ERROR, "kvtier: copies of loaded blocks failed: "
                           "%s (their blocks are load errors)", e)
        self.layer_events = None
        done, self._load_done = self._load_done, []
        busy = self._sync_s + self._copy_s
        for op, name, oks in done:
            if failed is not None:
                oks = [False] * len(oks)
            bad = [b for b, ok in zip(op.block_ids, oks) if not ok]
            if bad:
                self._add_errors(bad)
                self.unread(op, oks)
            self.report.loaded(op.req_id, not bad)
            n = sum(oks)
            if n:
                self.count(Metric.BYTES_LOADED.at(name), n * self.block_bytes)
                self.count(Metric.SECONDS_LOADED.at(name), busy / max(1, len(done)))
                self.count(Metric.BLOCKS_LOADED.at(name), n)
            if bad:
                self.count(Metric.BLOCKS_LOAD_FAILED.at(name), len(bad))

    # ---- asynchronous loads (the shared tier: reads ahead, copied in a later step) ---------------
    def load_async(self, ops: Sequence[LoadOp]) -> None:
        """Start these requests' loads: shared-tier reads begin now (into their promotion slots or
        rows of their own); `poll_async` runs the rest and reports each request once complete."""
        self.settle_rows()
        for op in ops:
            self._async.setdefault(op.req_id, []).append(op)
            h = self._handler_of(op.tier, Medium.OUTSIDE)
            if h is not None and h.reads_ahead:
                self._fetched[id(op)] = h.read_ahead(op, self.planes.get(op.tier))

    def poll_async(self, wait_s: float = 0.0) -> set[str]:
        """Requests whose asynchronous loads arrived (waiting up to `wait_s` for them): their
        blocks go to the outside now; returned once, failed ones too (with their load errors)."""
        if self._async and wait_s > 0:
            deadline = time.monotonic() + wait_s
            for ops in list(self._async.values()):
                for op in ops:
                    f = self._fetched.get(id(op))
                    left = deadline - time.monotonic()
                    if f is None or left <= 0:
                        continue
                    try:
                        f[-1].wait(left)
                    except Exception:  # noqa: BLE001 - still running (timeout) or failed: reported when done
                        pass
        if self._async:
            self.finish_loads()   # the step's own loads first: their failures taint its stores
        polling, self._polling = self._polling, True
        try:
            return self._poll_done()
        finally:
            self._polling = polling

    def _poll_done(self) -> set[str]:
        """Arrived requests' loads, together: on a layered outside (a device) the copies are queued
        and the consumer's later work waits for them (the host does not); else they run now."""
        done: set[str] = set()
        ready: list[LoadOp] = []
        for rid, ops in list(self._async.items()):
            if any(not self._fetched[id(op)][-1].done() for op in ops if id(op) in self._fetched):
                continue
            del self._async[rid]
            ready.extend(ops)
            done.add(rid)
        if ready:
            self.load(ready, layered=True)
            if self.layer_events:
                self.outside.wait_layer(self.layer_events[-1])
            self.finish_loads(wait=False)
            self._failed_done.update(rid for rid in done if self.report.load_failed(rid))
        if self._recv_failed:
            done |= self._recv_failed
            self._failed_done |= self._recv_failed
            self._recv_failed = set()
        return done

    def take_failed_recving(self) -> set[str]:
        """Requests `poll_async` / `fail_async` reported done whose load failed (in whole or part),
        since the last call: for callers that take failures per request, not per block."""
        out, self._failed_done = self._failed_done, set()
        return out

    @property
    def loads_in_flight(self) -> int:
        return len(self._async)

    # ---- failures: a load that fails anywhere (read, verify, staging, queuing its copy, the
    # layer's wait) is a load error for exactly the blocks of the requests it touched (vLLM
    # recomputes them) and taints the step: its forward read those blocks, so nothing it computed
    # is stored (`tainted`, until the next `begin_step`, whatever order vLLM takes the load errors
    # and the stores in). Outcomes go to `report` (`kvtier.core.plan.ReportBuilder`).

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
            self.count(Metric.LOAD_COPY_FAILED.key)
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
        self.count(Metric.BLOCKS_LOAD_FAILED.key, len(ids))
        self.once(("load_failed", why), logging.WARNING,
                   "kvtier: %d blocks of %s not loaded (%s): reported as load errors, recomputed", len(ids), req_id,
                   why)

    def unread(self, op: LoadOp, oks: Sequence[bool]) -> None:
        """Report the blocks of `op` not loaded (`oks` False), whatever the reason: the controller
        remembers them (`kvtier.core.ledger`). A shared-tier block (slot -1) by its key."""
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
        self.count(Metric.BLOCKS_STORE_DROPPED.key, n)

    # ---- stores and copies -------------------------------------------------------------------
    def store(self, ops: Sequence[StoreOp], tainted: bool = False, defer: bool = False) -> set[tuple[int, int]]:
        """outside -> the top tier's slots, all in one batch (after the step's compute; a device:
        one sync): DRAM slots, or a data file when the stack has no DRAM tier (`FileStore`: written
        and flushed now; from device staging rows when its engine writes device memory).
        `tainted`: this step's loads failed, so what it computed is not stored. Returns the
        (tier, slot) pairs whose store failed (a copy down from them must not run). `defer`: a
        device's copies are left running, in `deferred` (`take_deferred`, `store_done`, `store_lost`)."""
        failed: set[tuple[int, int]] = set()
        t0 = time.perf_counter()
        by: dict[Any, list[StoreOp]] = {}
        for op in ops:
            try:
                p = self.planes.plane_of(op.tier)
                by.setdefault(self.handlers.of(Medium.OUTSIDE, p.medium), []).append(op)
            except Exception as e:  # noqa: BLE001 - this op fails, the others run
                self.store_failed(op, e, tainted, failed)
        if any(h.stages for h in by):   # staging rows handed out again: the loads reading them done first
            self.finish_loads()
            self.settle_rows()
        planned: list = []
        ev = None
        for h, group in by.items():
            done, e, lost = h.store(group, tainted, defer and len(by) == 1)
            for lost_ops, why, quiet in lost:
                for op in lost_ops:
                    self.store_failed(op, why, quiet, failed)
            planned += done
            ev = e if e is not None else ev
        if ev is not None:
            self.deferred = (planned, ev, t0)
            return failed
        self.store_done(planned, time.perf_counter() - t0)
        return failed

    def store_failed(self, op: StoreOp, e: BaseException, tainted: bool, failed: set) -> None:
        """A store op failed (not logged when the step is `tainted`): its slots go to `failed`."""
        if not tainted:
            self.once(("store", op.tier) + cause(e), logging.WARNING,
                       "kvtier: store of %d blocks to %s failed: %s", len(op.slots), self.name(op.tier), e)
        self.report.not_stored(op.op_id, len(op.slots))
        failed.update((op.tier, s) for s in op.slots)

    def copy(self, ops: Sequence[CopyOp], failed: set[tuple[int, int]] = frozenset()) -> None:
        """DRAM -> DRAM, file or shared tier, each op by the handler of its (source medium, destination
        medium): each op's per-slot result (the block's tag, or -1: not durable, or its source failed
        this step) is reported within `write_lag_steps` (`CopiesDown`)."""
        by: dict[Any, list[CopyOp]] = {}
        for op in ops:
            try:
                h = self.handlers.of(self.planes.plane_of(op.src_tier).medium, self.planes.plane_of(op.tier).medium)
            except Exception as e:  # noqa: BLE001 - no plane or no handler: this op is dropped
                self.down.copy_failed([op], e)
                continue
            by.setdefault(h, []).append(op)
        for h in sorted(by, key=lambda h: h.order):
            for lost, why in h.copy(by[h], failed, self.steps):
                self.down.copy_failed(lost, why)
        if by and self.down.lag == 0:  # written on the caller's thread: reported now
            self.down.reap(self.steps, wait=True)

    # ---- copies left running on a device: reported once their event completed -----------------
    def take_deferred(self) -> tuple | None:
        """The last `store(defer=True)` left running, (planned, event, t0), once; or None."""
        d, self.deferred = self.deferred, None
        return d

    def store_done(self, planned: list, dt: float) -> None:
        """These stores' copies completed: reported stored, counted."""
        by_tier: dict[str, int] = {}
        for op, _ in planned:
            self.report.stored(op.op_id, [True] * len(op.slots))
            by_tier[self.name(op.tier)] = by_tier.get(self.name(op.tier), 0) + len(op.slots)
        for name, n in by_tier.items():
            self.count(Metric.BYTES_STORED.at(name), n * self.block_bytes)
            self.count(Metric.SECONDS_STORED.at(name), dt)
            self.count(Metric.BLOCKS_STORED.at(name), n)

    def store_lost(self, planned: list, e: BaseException) -> set[tuple[int, int]]:
        """These stores' copies failed or were given up: not stored; returns their (tier, slot)s."""
        failed: set[tuple[int, int]] = set()
        for op, _ in planned:
            self.store_failed(op, e, False, failed)
        return failed

    def settle_rows(self, ops: Sequence | None = None) -> None:
        """Before host rows are handed out again: the copies that read them last completed (a
        query; the host waits only for copies still running). With `ops` (loads), only when one
        of them writes host rows (a lower tier's read into staging or promotion slots): a copy
        from DRAM slots writes none."""
        if ops is not None and not any(op.via or self._staging_of(op) is not None for op in ops):
            return
        ev, self._rows_event = self._rows_event, None
        if ev is None or self.outside.done(ev):
            return
        try:
            self.outside.sync(ev)
        except Exception as e:  # noqa: BLE001 - a device error: the next copies report it
            self.once(("rows_wait",) + cause(e), logging.ERROR, "kvtier: waiting for the last load's copies "
                      "failed: %s", e)

    def reap(self, wait: bool = False) -> None:
        """Report the copies done; wait for those `write_lag_steps` old (all if `wait`)."""
        self.down.reap(self.steps, wait)

    @property
    def writes_in_flight(self) -> int:
        return len(self.down)

    @property
    def file_writes_in_flight(self) -> int:
        """Batches of copies to a file (NVMe) still being written behind."""
        return len(self.down.writes)

    @property
    def errors(self) -> list[str]:
        """I/O errors of copies down since the caller last took them (the CLI's exit)."""
        return list(self.down.errors)

    def take_errors(self) -> list[str]:
        """The I/O errors of copies down so far, once."""
        return self.down.take_errors()

    @property
    def corrupt_blocks(self) -> int:
        """Blocks that failed verification on read, over this executor's life."""
        return self.report.corrupt_blocks

    # ---- one synchronous round (the CLI, replay) -------------------------------------------
    def run(self, plan: Plan) -> Report:
        """Loads, stores, then copies of `plan`, all waited for; the report."""
        self.load(plan.loads)
        failed = self.store(plan.stores)
        self.copy(plan.copies, failed)
        self.reap(wait=True)
        return self.take_report() or self.report.empty()

    # ---- the report --------------------------------------------------------------------------
    def step(self) -> Report | None:
        """This step's report (once per step): loads, stores, copies now durable; None if empty."""
        self.finish_loads()
        self.reap()
        return self.take_report()

    def take_report(self) -> Report | None:
        """The report built since the last call (None if empty); a step ends."""
        self.steps += 1
        return self.report.take()

    @property
    def has_load_errors(self) -> bool:
        """Load errors not yet taken (`take_load_errors`)."""
        return bool(self._load_errors)

    def take_load_errors(self, finish: bool = True) -> set[int]:
        if finish:
            self.finish_loads()
        e, self._load_errors = self._load_errors, set()
        return e

    # ---- shutdown ------------------------------------------------------------------------------
    def drain(self, timeout_s: float) -> tuple[int, int]:
        """Wait (bounded) for every copy in flight and report it; returns the batches left running
        (file, shared): their blocks are never reported, so never indexed."""
        self.finish_loads()
        self.settle_rows()
        for *_, h in list(self._fetched.values()):  # reads ahead into DRAM slots: let them land
            try:
                h.wait()
            except Exception:  # noqa: BLE001 - pragma: no cover (reported through the handle)
                pass
        self._fetched.clear()
        self._async.clear()
        late_puts = self.down.puts.drain(timeout_s) if len(self.down.puts) else 0
        late = self.down.writes.drain(timeout_s) if len(self.down.writes) else 0
        self.reap(wait=True)
        return late, late_puts

    def close(self, wait: bool = True) -> None:
        self.down.writes.close(wait=wait)
        self.down.puts.close(wait=wait)
