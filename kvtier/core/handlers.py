"""The executor's handlers: one small class per (source medium, destination medium), in `HANDLERS`.

An op moves blocks between two media (`kvtier.tiers.contract.Medium`): a tier's data plane and
the caller's blocks (`OUTSIDE`). The executor (`kvtier.core.executor`) builds one handler of each
class from its parts (`Handlers`) and hands each op to the handler of its pair:

    HOST    -> OUTSIDE  HostLoad     load from DRAM (a promotion from a lower DRAM tier: a memcpy)
    FILE    -> OUTSIDE  FileLoad     NVMe read into promotion slots, staging rows or device staging, verified
    SHARED  -> OUTSIDE  SharedLoad   shared-tier GET, verified (read ahead when asynchronous)
    OUTSIDE -> HOST     HostStore    store: the caller's blocks into DRAM slots, one batch
    OUTSIDE -> FILE     FileStore    store into NVMe (no DRAM tier above it): written, flushed, tagged;
                                     from device staging rows when the engine writes device memory (GDS)
    HOST    -> HOST     HostCopy     DRAM -> DRAM copy down, a memcpy done at once
    HOST    -> FILE     FileCopy     copy down: NVMe write, fdatasync, written behind
    HOST    -> SHARED   SharedCopy   copy to the fleet's server, written behind

A handler is given what it works with when it is built (the tiers' data planes, the outside, the
staging rows, the report, the counter, the log-once, a write-behind queue) and keeps no state of
its own. It adds each op's outcome to the report (`kvtier.core.plan.ReportBuilder`) or returns the
ops that failed to the executor, per block (a miss, a load error, a store not committed), never
raising into a step.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any, Callable, Sequence

import torch

from kvtier.common.counters import Metric
from kvtier.common.once import Once, cause
from kvtier.core.outside import Outside
from kvtier.core.plan import CopyOp, LoadOp, ReportBuilder, StoreOp
from kvtier.core.staging import Staging
from kvtier.tiers.contract import DataPlane, Medium
from kvtier.tiers.cpu_pool import copy_blocks
from kvtier.tiers.io_engine import DoneHandle, IOResult, fault_point

HOST, FILE, SHARED, OUTSIDE = Medium.HOST, Medium.FILE, Medium.SHARED, Medium.OUTSIDE
Failed = list[tuple[list[CopyOp], BaseException | None]]   # copies not started, with why: the caller reports them


class LoadRun:
    """One `Executor.load` call's shared state: the copies queued (`jobs`), the staging rows,
    whether copies run now, chunk by chunk (`chunk_bytes` read each) as reads land (`copy_now`),
    and the seconds those copies took (`copy_s`)."""

    def __init__(self, jobs: list, stage: list, copy_now: bool, chunk_bytes: int, dstage: list | None = None) -> None:
        self.jobs = jobs
        self.stage = stage
        self.row0 = 0
        self.dstage = dstage or []   # rows of the outside's device staging (`Outside.device_staging`)
        self.drow0 = 0
        self.copy_now = copy_now
        self.chunk_bytes = chunk_bytes
        self.copy_s = 0.0


def run_copies(outside: Outside, jobs: list) -> None:
    """Run load copies into the outside now."""
    fault_point("load_copy")
    outside.run(jobs, to_outside=True)


# ---- loads: a tier -> the caller's blocks ------------------------------------------------------
class HostLoad:
    pair = (HOST, OUTSIDE)
    stages = False        # reads straight from its slots: no staging rows
    reads_ahead = False

    def __init__(self, planes: Planes, outside: Outside, report: ReportBuilder) -> None:
        self.planes, self.outside, self.report = planes, outside, report

    def load(self, op: LoadOp, plane: DataPlane, run: LoadRun, at: int, pre: tuple | None = None) -> list[bool]:
        self.planes.host_pool(op.tier, op.slots)
        run.jobs.append((at, self.outside.job(plane.rows, op.block_ids, op.slots, [plane.views[s] for s in op.slots])))
        oks = [True] * len(op.slots)
        if op.via:  # promoted from a lower DRAM tier: a memcpy into the upper tier's slots
            up = self.planes.host_pool(op.via_tier)
            copy_blocks([up.views[s] for s in op.via], [plane.views[s] for s in op.slots], self.planes.block_bytes)
            self.report.stored(op.op_id, oks)
        return oks


class ReadLoad:
    """A lower tier's load: read into the promotion slots `op.via`, rows of its own (read ahead),
    the outside's own buffers, device staging rows (`device_staged`) or staging rows; each block
    verified; then its copy into the outside goes to `run.jobs`, or runs chunk by chunk as each
    chunk's reads land. Only verified blocks are copied into the outside."""

    stages = True
    reads_ahead = False

    def __init__(self, planes: Planes, outside: Outside, report: ReportBuilder, staging: Staging | None,
                 count: Callable[..., None], once: Once) -> None:
        self.planes, self.outside, self.report, self.staging = planes, outside, report, staging
        self.count, self.once = count, once

    def check(self, op: LoadOp, n: int) -> None:
        """What the op must carry for this medium's reads."""

    def note(self, op: LoadOp, lo: int, r: IOResult, corrupt: list[int]) -> None:
        """A chunk's failures, from `op.slots[lo]` on."""

    def device_staged(self, op: LoadOp, plane: DataPlane) -> bool:
        """Whether the op reads into the outside's device staging rows."""
        return False

    def load(self, op: LoadOp, plane: DataPlane, run: LoadRun, at: int, pre: tuple | None = None) -> list[bool]:
        """`pre`: the reads `read_ahead` started for the op (host, rows, buffers, handle), if any."""
        n = len(op.slots)
        self.check(op, n)
        planes, outside, name = self.planes, self.outside, self.planes.name(op.tier)
        direct = None
        if pre is not None:  # read ahead (an asynchronous load)
            host, rows, bufs, h = pre
            reads = [(0, h)]
        else:
            if op.via:
                pool = planes.host_pool(op.via_tier)
                host, rows, bufs = pool.rows, list(op.via), [pool.views[s] for s in op.via]
            elif outside.direct_reads:
                direct = outside.direct(op.block_ids)
                host, rows, bufs = None, list(range(n)), direct
            elif self.device_staged(op, plane):
                r0 = run.drow0
                host, rows, bufs = outside.device_staging.rows(), list(range(r0, r0 + n)), run.dstage[r0:r0 + n]
            else:
                r0 = run.row0
                host, rows, bufs = self.staging.rows(), list(range(r0, r0 + n)), run.stage[r0:r0 + n]
            step = max(1, run.chunk_bytes // planes.block_bytes) if run.copy_now else n
            reads = []  # every chunk in flight at once: the engine's threads keep the disk / server busy
            for lo in range(0, n, step):
                hi = min(n, lo + step)
                reads.append((lo, plane.read(op.slots[lo:hi], bufs[lo:hi], op.keys[lo:hi] if op.keys else None,
                                             None if op.checksums is None else op.checksums[lo:hi])))
        oks: list[bool] = []       # in the outside
        read_oks: list[bool] = []  # read and verified (in the promotion slots `op.via`)
        corrupt: list[int] = []
        errors: list[str] = []
        for lo, h in reads:
            r = h.wait()
            read_oks.extend(r.ok)
            ok = list(r.ok)
            errors.extend(r.errors)
            self.note(op, lo, r, corrupt)
            good = [lo + i for i, ok in enumerate(r.ok) if ok]
            if good and direct is None:
                job = outside.job(host, [op.block_ids[i] for i in good], [rows[i] for i in good],
                                  [bufs[i] for i in good])
                if not run.copy_now:
                    run.jobs.append((at, job))
                else:  # this chunk now; a failed copy fails its blocks, the other chunks' reads go on
                    t1 = time.perf_counter()
                    try:
                        run_copies(outside, [job])
                    except Exception as e:  # noqa: BLE001 - load errors
                        self.count(Metric.LOAD_COPY_FAILED.key)
                        self.once(("load_copy", name) + cause(e), logging.ERROR,
                                  "kvtier: copying %d blocks of %s into the KV failed: %s (load errors, "
                                  "recomputed)", len(good), op.req_id, e)
                        ok = [False] * len(ok)
                    finally:
                        run.copy_s += time.perf_counter() - t1
            oks.extend(ok)
        if corrupt:
            self.count(Metric.CORRUPT_BLOCKS.at(name), len(corrupt))
            self.report.corrupt(op.tier, corrupt)
            self.once(("corrupt", op.tier), logging.ERROR, "kvtier: %d blocks of %s from %s failed verification; "
                      "reported (recomputed, quarantined): %s", len(corrupt), op.req_id, name, errors[:2])
        if op.via:
            self.report.stored(op.op_id, read_oks)
        return oks


class FileLoad(ReadLoad):
    pair = (FILE, OUTSIDE)

    def check(self, op: LoadOp, n: int) -> None:
        if op.checksums is None or len(op.checksums) != n:
            raise RuntimeError("file load without expected checksums")

    def note(self, op: LoadOp, lo: int, r: IOResult, corrupt: list[int]) -> None:
        """Failed verification: reported, the controller quarantines the slots."""
        corrupt.extend(op.slots[lo + i] for i, b in enumerate(r.bad) if b)

    def device_staged(self, op: LoadOp, plane: DataPlane) -> bool:
        """A load with no promotion slot, from a data file whose engine reads device memory
        (GPUDirect Storage), into an outside with device staging rows: file -> device, verified
        there, then scattered."""
        return (not op.via and plane.device_reads and self.outside.device_staging is not None
                and not self.outside.direct_reads)


class SharedLoad(ReadLoad):
    pair = (SHARED, OUTSIDE)
    reads_ahead = True    # asynchronous loads start their GETs at once (`read_ahead`)

    def check(self, op: LoadOp, n: int) -> None:
        if not op.keys or len(op.keys) != n:
            raise RuntimeError("shared-tier load without keys")

    def note(self, op: LoadOp, lo: int, r: IOResult, corrupt: list[int]) -> None:
        """Absent (the server evicted it) or failed verification (`bad`): a miss, reported."""
        self.report.shared_misses([op.keys[lo + i] for i, ok in enumerate(r.ok) if not ok],
                                  [op.keys[lo + i] for i, b in enumerate(r.bad) if b])

    def read_ahead(self, op: LoadOp, plane: DataPlane) -> tuple:
        """Start the op's reads into its promotion slots or rows of its own: (host, rows, buffers,
        handle), handed back to `load`. Rows of its own are pinned (torch's pinned host allocator)
        when the outside is a device's: the staging rows' pinning says so."""
        n = len(op.keys or [])
        try:
            if op.via:
                pool = self.planes.host_pool(op.via_tier, op.via)
                host, rows = pool.rows, list(op.via)
            else:
                pin = bool(self.staging is not None and self.staging.pinned and self.outside.layered)
                host, rows = torch.empty((n, self.planes.block_bytes), dtype=torch.uint8, pin_memory=pin), [*range(n)]
            bufs = [host[r] for r in rows]
            h = plane.read(op.slots, bufs, op.keys)
        except Exception as e:  # noqa: BLE001 - a miss, reported with the load
            self.once(("shared_read",) + cause(e), logging.WARNING,
                      "kvtier: shared-tier read of %d blocks for %s failed: %s", n, op.req_id, e)
            host, rows, bufs = None, [], []
            h = DoneHandle(IOResult(ok=[False] * n, errors=[str(e)]))
        return host, rows, bufs, h


# ---- stores: the caller's blocks -> DRAM slots -------------------------------------------------
class HostStore:
    pair = (OUTSIDE, HOST)
    stages = False   # copies into DRAM slots: no staging rows

    def __init__(self, planes: Planes, outside: Outside) -> None:
        self.planes, self.outside = planes, outside

    def store(self, ops: Sequence[StoreOp], tainted: bool, defer: bool = False) -> tuple[list, Any, list]:
        """All in one batch; returns the (op, job)s stored, with `defer` on a device the event their
        copies complete at (else None: done), and the ops that failed as (ops, why, quiet): `quiet`
        when the step is `tainted` (a load failed this step: not logged)."""
        planned: list[tuple[StoreOp, Any]] = []
        failed: list[tuple[list[StoreOp], BaseException, bool]] = []
        for op in ops:
            try:
                if tainted:
                    raise RuntimeError("a load failed this step")
                pool = self.planes.host_pool(op.tier, op.slots)
                planned.append((op, self.outside.job(pool.rows, op.block_ids, op.slots,
                                                     [pool.views[s] for s in op.slots])))
            except Exception as e:  # noqa: BLE001 - this op fails, the others run
                failed.append(([op], e, tainted))
        ev = None
        if planned:
            try:
                fault_point("store_copy")
                ev = self.outside.store_async([j for _, j in planned])
                if not defer:
                    self.outside.sync(ev)
                    ev = None
            except Exception as e:  # noqa: BLE001
                failed.append(([op for op, _ in planned], e, False))
                planned, ev = [], None
        return planned, ev, failed


# ---- stores: the caller's blocks -> a data file (a stack whose top tier is NVMe) -----------------
class FileStore:
    """A store into a data file's pending slots, done before `store` returns: each block sealed
    under its key (`op.keys`), the file flushed (fdatasync), then reported with its tags
    (`ReportBuilder.stored`), which the controller indexes. The payload is written from
    (`source`):

    - "direct": the caller's own tensors (an outside with `direct_reads`: the CLI's buffers);
    - "device": rows of the outside's device staging (`Outside.device_staging`), when the file's
      engine writes device memory (`device_reads`: kvikio, GPUDirect Storage): the blocks are
      gathered there on the device, their keyed payload sum (`block_sum.KeyedSum`) computed there
      and the payload written device -> file; only the header page is built on the host;
    - "host": the executor's host staging rows, the blocks gathered into them first.
    """

    pair = (OUTSIDE, FILE)
    stages = True   # hands out staging rows: the executor settles its loads' rows first

    def __init__(self, planes: Planes, outside: Outside, report: ReportBuilder, staging: Staging | None,
                 count: Callable[..., None], once: Once) -> None:
        self.planes, self.outside, self.report, self.staging = planes, outside, report, staging
        self.count, self.once = count, once

    def source(self, plane: DataPlane) -> str:
        """Where a store into `plane` writes its payload from: "direct", "device" or "host"."""
        if self.outside.direct_reads:
            return "direct"
        if plane.device_reads and self.outside.device_staging is not None:
            return "device"
        return "host"

    def store(self, ops: Sequence[StoreOp], tainted: bool, defer: bool = False) -> tuple[list, Any, list]:
        """Writes, flushes and reports `ops` now (`defer` is not taken: nothing is left running);
        returns ([], None, the ops that failed whole as (ops, why, quiet)). A block whose write
        failed is reported not stored (tag -1), the others of its op stored."""
        if tainted:
            return [], None, [(list(ops), RuntimeError("a load failed this step"), True)]
        t0 = time.perf_counter()
        failed: list[tuple[list[StoreOp], BaseException, bool]] = []
        runs: list[tuple[StoreOp, Any, str]] = []
        for op in ops:
            try:
                plane = self.planes.plane_of(op.tier, FILE)
                if len(op.keys) != len(op.slots):
                    raise RuntimeError("a store into a file without its blocks' keys")
                runs.append((op, plane, self.source(plane)))
            except Exception as e:  # noqa: BLE001 - this op fails, the others run
                failed.append(([op], e, False))
        bufs = self._gather(runs, failed)
        writes = []
        for op, plane, src in runs:
            if id(op) not in bufs:
                continue
            try:
                writes.append((op, plane, src, plane.write(op.slots, bufs[id(op)], op.keys)))
            except Exception as e:  # noqa: BLE001 - not handed over: this op fails
                failed.append(([op], e, False))
        done = []
        for op, plane, src, h in writes:
            try:
                done.append((op, plane, src, h.wait()))
            except Exception as e:  # noqa: BLE001 - the engine failed the whole op: it fails, the others go on
                failed.append(([op], e, False))
        tags: dict[int, list[int]] = {}                # op id -> per block tag, durable
        synced: dict[int, BaseException | None] = {}   # plane id -> its fdatasync's failure
        for plane in {id(p): p for _, p, _, _ in done}.values():   # durable before the index says so
            mine = [(op, r) for op, p, _, r in done if p is plane]
            per_op, synced[id(plane)] = durable_tags(plane, [r for _, r in mine])
            tags.update((id(op), t) for (op, _), t in zip(mine, per_op))
        self._report(done, tags, synced, time.perf_counter() - t0)
        return [], None, failed

    def _gather(self, runs: list, failed: list) -> dict[int, list]:
        """op id -> the buffers its blocks are written from: the caller's own, or staging rows the
        blocks were copied into (one batch, waited for)."""
        outside, out = self.outside, {}
        jobs, staged = [], []
        for where in ("device", "host"):
            mine = [(op, plane) for op, plane, src in runs if src == where]
            if not mine:
                continue
            try:
                st = outside.device_staging if where == "device" else self.staging
                if st is None:
                    raise RuntimeError("no host staging rows to gather the blocks into")
                views, rows, r0 = st.views(sum(len(op.slots) for op, _ in mine)), st.rows(), 0
            except Exception as e:  # noqa: BLE001 - e.g. out of device memory: these ops fail
                failed.append(([op for op, _ in mine], e, False))
                continue
            for op, _ in mine:
                n = len(op.slots)
                out[id(op)] = views[r0:r0 + n]
                jobs.append(outside.job(rows, op.block_ids, list(range(r0, r0 + n)), out[id(op)]))
                staged.append(op)
                r0 += n
        for op, _, src in runs:
            if src == "direct":
                try:
                    out[id(op)] = outside.direct(op.block_ids)
                except Exception as e:  # noqa: BLE001 - this op fails
                    failed.append(([op], e, False))
        if jobs:
            try:
                fault_point("store_copy")
                outside.sync(outside.store_async(jobs))
            except Exception as e:  # noqa: BLE001 - the gather failed: none of them is written
                failed.append((staged, e, False))
                for op in staged:
                    out.pop(id(op), None)
        return out

    def _report(self, done: list, durable: dict, synced: dict, dt: float) -> None:
        """Each op's per-block tags (`durable`; -1: not written or not durable), counted; the path
        each tier's stores take is logged once."""
        bb = self.planes.block_bytes
        by_tier: dict[str, int] = {}
        for op, plane, src, r in done:
            name = self.planes.name(op.tier)
            err = synced.get(id(plane))
            tags = durable[id(op)] + [-1] * (len(op.slots) - len(durable[id(op)]))
            self.report.stored(op.op_id, [c != -1 for c in tags], tags=tags)
            n = sum(1 for c in tags if c != -1)
            by_tier[name] = by_tier.get(name, 0) + n
            if n and src == "device":
                self.count(Metric.DEVICE_STORED_BLOCKS.at(name), n)
            self.once(("file_store", name, src), logging.INFO, "kvtier: stores into %s: %s (%s)", name,
                      _STORE_PATHS[src], plane.description)
            why = err if err is not None else (r.errors[0] if r.errors else None)
            if n < len(tags) and why is not None:
                self.once(("file_store_failed", name) + (cause(err) if err is not None else ()), logging.ERROR,
                          "kvtier: %d of %d blocks stored into %s failed: %s (not committed; counted in "
                          "store_failed_blocks)", len(tags) - n, len(tags), name, why)
        for name, n in by_tier.items():
            if n:
                self.count(Metric.BYTES_STORED.at(name), n * bb)
                self.count(Metric.BLOCKS_STORED.at(name), n)
            self.count(Metric.SECONDS_STORED.at(name), dt)


_STORE_PATHS = {
    "direct": "payload written from the caller's buffers",
    "device": "gathered into device staging rows, payload sum computed on the device, payload written "
              "device -> file (no host copy of it; header pages on the host)",
    "host": "gathered into host staging rows, written host -> file",
}


# ---- copies down: DRAM -> a lower tier -----------------------------------------------------------
class HostCopy:
    pair = (HOST, HOST)
    order = 0

    def __init__(self, planes: Planes, report: ReportBuilder, count: Callable[..., None]) -> None:
        self.planes, self.report, self.count = planes, report, count

    def copy(self, ops: list[CopyOp], failed: set, step: int) -> Failed:
        """A memcpy, done at once; returns the ops not copied (with why)."""
        planes, out = self.planes, []
        for op in ops:
            try:
                src, dst = planes.host_pool(op.src_tier, op.src_slots), planes.host_pool(op.tier, op.slots)
                copy_blocks([dst.views[s] for s in op.slots], [src.views[s] for s in op.src_slots], planes.block_bytes)
            except Exception as e:  # noqa: BLE001
                out.append(([op], e))
                continue
            self.report.copied(op.op_id, [-1 if (op.src_tier, s) in failed else 0 for s in op.src_slots])
            n = len(op.slots)
            self.count(Metric.BYTES_STORED.at(planes.name(op.tier)), n * planes.block_bytes)
            self.count(Metric.BLOCKS_STORED.at(planes.name(op.tier)), n)
        return out


class BehindCopy:
    """Writes handed to the data plane now, waited for (and made durable) behind the step by this
    medium's `WriteBehind` queue (`behind`)."""

    def __init__(self, planes: Planes, behind: WriteBehind) -> None:
        self.planes, self.behind = planes, behind

    def copy(self, ops: list[CopyOp], failed: set, step: int) -> Failed:
        """Hands the writes over; returns the ops not started (with why; None: a stale source)."""
        planes, out = self.planes, []
        # a source slot whose store failed holds stale bytes: never written anywhere, not even to a
        # slot the index will not take (`fsck --rebuild` indexes what the block headers say)
        stale = [op for op in ops if any((op.src_tier, s) in failed for s in op.src_slots)]
        if stale:
            out.append((stale, None))
        ops = [op for op in ops if op not in stale]
        batch: list = []
        try:
            srcs = [[planes.host_pool(op.src_tier, op.src_slots).views[s] for s in op.src_slots] for op in ops]
            for op, views in zip(ops, srcs):  # every check before the first transfer is handed over
                batch.append((op, planes.plane_of(op.tier).write(op.slots, views, op.keys)))
        except Exception as e:  # noqa: BLE001 - the copies not handed over are dropped
            started = {id(b[0]) for b in batch}
            out.append(([op for op in ops if id(op) not in started], e))
        if batch:
            self.behind.submit(step, planes.plane_of(batch[0][0].tier), batch, {s for t, s in failed})
        return out


class SharedCopy(BehindCopy):
    pair = (HOST, SHARED)
    order = 1


class FileCopy(BehindCopy):
    pair = (HOST, FILE)
    order = 2


HANDLERS: dict[tuple[Medium, Medium], type] = {
    h.pair: h for h in (HostLoad, FileLoad, SharedLoad, HostStore, FileStore, HostCopy, SharedCopy, FileCopy)}


class Handlers:
    """One executor's handlers, one of each class of `HANDLERS`, built from its parts."""

    def __init__(self, planes: Planes, outside: Outside, report: ReportBuilder, staging: Staging | None,
                 count: Callable[..., None], once: Once, writes: WriteBehind, puts: WriteBehind) -> None:
        reads = (planes, outside, report, staging, count, once)
        made = (HostLoad(planes, outside, report), FileLoad(*reads), SharedLoad(*reads), HostStore(planes, outside),
                FileStore(*reads), HostCopy(planes, report, count), SharedCopy(planes, puts), FileCopy(planes, writes))
        self._by_pair: dict[tuple[Medium, Medium], Any] = {h.pair: h for h in made}

    def get(self, src: Medium, dst: Medium) -> Any:
        """The handler of (src, dst), None when there is none."""
        return self._by_pair.get((src, dst))

    def of(self, src: Medium, dst: Medium) -> Any:
        """The handler of (src, dst); RuntimeError naming the pair when there is none."""
        h = self._by_pair.get((src, dst))
        if h is None:
            raise RuntimeError(f"no handler moves blocks from {src.value} to {dst.value}")
        return h


# ---- the tiers' data planes in one process -----------------------------------------------------------
class Planes:
    """`planes[i]`: tier i's data plane (CpuPool, NvmeData or SharedData), None where this process has
    none; `tier_names` name the counters (`bytes_loaded.<tier>`...); `block_bytes`: one block."""

    def __init__(self, planes: Sequence[DataPlane | None], block_bytes: int, tier_names: Sequence[str] = ()) -> None:
        self._planes: list[DataPlane | None] = list(planes)
        self.block_bytes = block_bytes
        self._names = list(tier_names)

    def bind(self, tier_names: Sequence[str] | None = None, planes: dict[int, DataPlane | None] | None = None,
             ntiers: int = 0) -> None:
        """The tiers' names (when given), and tiers' data planes by index (None: none here);
        `ntiers`: room for that many."""
        if tier_names:
            self._names = list(tier_names)
        for t, p in (planes or {}).items():
            self._planes += [None] * (t + 1 - len(self._planes))
            self._planes[t] = p
        self._planes += [None] * (ntiers - len(self._planes))

    def name(self, tier: int) -> str:
        return self._names[tier] if tier < len(self._names) else str(tier)

    def get(self, tier: int) -> DataPlane | None:
        """Tier `tier`'s plane, None when this process has none."""
        return self._planes[tier] if tier < len(self._planes) else None

    def plane_of(self, tier: int, medium: Medium | None = None) -> DataPlane:
        p = self.get(tier)
        if p is None:
            raise RuntimeError(f"no data plane for tier {self.name(tier)} in this process")
        if medium is not None and p.medium is not medium:
            raise RuntimeError(f"tier {self.name(tier)} is {p.medium.name}, not {medium.name}")
        return p

    def host_pool(self, tier: int, slots: Sequence[int] | None = None):
        """Tier `tier`'s DRAM pool; `slots` must lie in it (a worker's pool may be smaller than the
        scheduler's tier until the scheduler follows its report)."""
        pool = self.plane_of(tier, Medium.HOST)
        if slots and max(slots) >= pool.num_slots:
            raise RuntimeError(f"slot {max(slots)} beyond the {pool.num_slots}-slot pool of tier {self.name(tier)}")
        return pool


# ---- NVMe write-behind -------------------------------------------------------------------------------
Done = tuple[list[tuple[Any, list[int]]], float, list[str]]   # ([(op, per-slot tags)], seconds, errors)


class WriteBehind:
    """Write-behind of copies down (to a file, to the shared tier): the caller's step never waits.

    `submit` takes a step's batch of writes already handed to the I/O engine; one flusher thread
    waits for them, fdatasyncs the data file once and turns each op into per-slot tags (-1: not
    durable, or its CPU source failed this step). `reap` returns the finished batches, waiting for
    those `lag` steps old, so every write is reported (and then indexed by the controller) at the
    latest `lag` steps after the step that queued it."""

    def __init__(self, lag_steps: int) -> None:
        self.lag = max(0, int(lag_steps))
        self._pending: list[tuple[int, Future]] = []
        self._pool: ThreadPoolExecutor | None = None

    def __len__(self) -> int:
        return len(self._pending)

    def submit(self, step: int, nvme: Any, batch: list, failed_src: set[int]) -> None:
        """`batch`: (op, tags list the engine fills, write handle) per write op. With a lag of 0 the
        batch is flushed here, on the caller's thread (the CLI: no thread of ours to outlive it)."""
        t0 = time.perf_counter()
        if self.lag == 0:
            done: Future = Future()
            done.set_result(_flush(nvme, batch, set(failed_src), t0))
            self._pending.append((step, done))
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-nvme-flush")
        self._pending.append((step, self._pool.submit(_flush, nvme, batch, set(failed_src), t0)))

    def reap(self, step: int, wait: bool = False) -> list[Done]:
        """Finished batches, waiting for those `lag` steps old (all when `wait`)."""
        out, keep = [], []
        for st, fut in self._pending:
            if wait or fut.done() or step - st >= self.lag:
                out.append(fut.result())
            else:
                keep.append((st, fut))
        self._pending = keep
        return out

    def drain(self, timeout_s: float) -> int:
        """Wait up to `timeout_s` for every batch; drops (and returns the count of) those still
        running: their blocks are never reported, so never indexed."""
        if not self._pending:
            return 0
        _, late = wait_futures([f for _, f in self._pending], timeout=timeout_s)
        self._pending = [(st, f) for st, f in self._pending if f not in late]
        return len(late)

    def close(self, wait: bool = True) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=wait, cancel_futures=True)
            self._pool = None
        self._pending = []


def durable_tags(plane: Any, results: Sequence[IOResult]) -> tuple[list[list[int]], BaseException | None]:
    """Writes into one data file made durable: one fdatasync when any block was written, then per
    result, per block its tag (-1: not written, or the fdatasync failed: returned)."""
    err = None
    if any(any(r.ok) for r in results):
        try:
            plane.sync()
        except Exception as e:  # noqa: BLE001 - nothing of this file is durable
            err = e
    return [[c if ok and err is None else -1 for c, ok in zip(r.tags or [0] * len(r.ok), r.ok)]
            for r in results], err


def _flush(nvme: Any, batch: list, failed_src: set[int], t0: float) -> Done:
    """The flusher thread: wait for a batch's writes, fdatasync once, per-op tags (-1: failed)."""
    try:
        results = [(op, h.wait()) for op, h in batch]
    except Exception as e:  # noqa: BLE001 - the batch is not durable: reported, the sources stay
        return [(op, [-1] * len(op.src_slots)) for op, _ in batch], time.perf_counter() - t0, [str(e)]
    tags, err = durable_tags(nvme, [r for _, r in results])
    if err is not None:
        return [(op, [-1] * len(op.src_slots)) for op, _ in batch], time.perf_counter() - t0, [str(err)]
    out = [(op, [c if src not in failed_src else -1 for c, src in zip(t, op.src_slots)])
           for (op, _), t in zip(results, tags)]
    return out, time.perf_counter() - t0, [e for _, r in results for e in r.errors]


class CopiesDown:
    """An executor's copies down written behind: the queues the handlers of `kvtier.core.handlers`
    hand their writes to (`writes`: to a file, `puts`: to the shared tier), and each op's per-slot
    result (the block's tag, or -1: not durable, or its source failed this step) reported within
    `lag` steps (`reap`)."""

    def __init__(self, planes: Planes, report: ReportBuilder, count: Callable[..., None], once: Once,
                 lag_steps: int) -> None:
        self.planes, self.report, self.count, self.once = planes, report, count, once
        self.lag = max(0, int(lag_steps))
        self.errors: list[str] = []              # the engine's words (errno, path) since last cleared
        self.writes = WriteBehind(lag_steps)   # to a file, in flight
        self.puts = WriteBehind(lag_steps)     # to the shared tier, in flight

    def __len__(self) -> int:
        return len(self.writes) + len(self.puts)

    def take_errors(self) -> list[str]:
        """The engine's errors since the last call, once."""
        out, self.errors = self.errors, []
        return out

    def copy_failed(self, ops: list[CopyOp], e: BaseException | None) -> None:
        """Copies not started (`e`: why, logged once) or whose source is stale: all slots -1."""
        if e is not None and ops:
            self.once(("copy", ops[0].tier) + cause(e), logging.WARNING, "kvtier: copy of %d ops to %s not "
                      "started: %s (dropped; the source copies stay)", len(ops), self.planes.name(ops[0].tier), e)
        for op in ops:
            self.report.copied(op.op_id, [-1] * len(op.src_slots))

    def reap(self, step: int, wait: bool = False) -> None:
        """Report finished copies; wait for those `lag` steps old (all if `wait`)."""
        for behind in (self.writes, self.puts):  # the shared tier's client logs its own failures (breaker)
            for done, dt, errors in behind.reap(step, wait):
                n, name = 0, None
                for op, out in done:
                    self.report.copied(op.op_id, out)
                    n += sum(1 for c in out if c != -1)
                    name = self.planes.name(op.tier)
                if errors:  # the engine's words: errno and path
                    self.errors.extend(errors)
                if errors and behind is self.writes:
                    self.once(("copy_failed", name), logging.ERROR, "kvtier: copies to %s failed: %s (the "
                              "source copies stay; counted in store_failed_blocks)", name, errors[0])
                if name is not None:
                    self.count(Metric.BYTES_STORED.at(name), n * self.planes.block_bytes)
                    self.count(Metric.SECONDS_STORED.at(name), dt)
                    self.count(Metric.BLOCKS_STORED.at(name), n)
