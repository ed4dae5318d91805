"""The executor's handlers: one small class per (source medium, destination medium), in `HANDLERS`.

An op moves blocks between two media (`kvtier.tiers.contract.Medium`): a tier's data plane and
the caller's blocks (`OUTSIDE`). The executor (`kvtier.core.executor`) and its copies down
(`kvtier.core.write_behind.CopiesDown`) look the op's pair up here and hand the op over:

    HOST    -> OUTSIDE  HostLoad     load from DRAM (a promotion from a lower DRAM tier: a memcpy)
    FILE    -> OUTSIDE  FileLoad     NVMe read into promotion slots or staging rows, verified
    SHARED  -> OUTSIDE  SharedLoad   shared-tier GET, verified (read ahead when asynchronous)
    OUTSIDE -> HOST     HostStore    store: the caller's blocks into DRAM slots, one batch
    HOST    -> HOST     HostCopy     DRAM -> DRAM copy down, a memcpy done at once
    HOST    -> FILE     FileCopy     copy down: NVMe write, fdatasync, written behind
    HOST    -> SHARED   SharedCopy   copy to the fleet's server, written behind

A handler keeps no state of its own: it works through the public calls of the executor (`ex`)
it is handed, adds each op's outcome to `ex.report` (`kvtier.core.plan.ReportBuilder`), and reports
every failure per block (a miss, a load error, a store not committed), never raising into a step.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from kvtier.tiers.once import cause
from kvtier.core.plan import CopyOp, LoadOp, StoreOp
from kvtier.tiers.contract import DataPlane, Medium
from kvtier.tiers.cpu_pool import copy_blocks
from kvtier.tiers.handles import DoneHandle, IOResult
from kvtier.tiers.io_hooks import fault_point
from kvtier.tiers.counters import Metric

HOST, FILE, SHARED, OUTSIDE = Medium.HOST, Medium.FILE, Medium.SHARED, Medium.OUTSIDE


class LoadRun:
    """One `Executor.load` call's shared state: the copies queued (`jobs`), the staging rows, and
    whether copies run now, chunk by chunk as reads land (`copy_now`)."""

    def __init__(self, jobs: list, stage: list, copy_now: bool) -> None:
        self.jobs = jobs
        self.stage = stage
        self.row0 = 0
        self.copy_now = copy_now


# ---- loads: a tier -> the caller's blocks ------------------------------------------------------
class HostLoad:
    pair = (HOST, OUTSIDE)
    stages = False        # reads straight from its slots: no staging rows
    reads_ahead = False

    def load(self, ex: Any, op: LoadOp, plane: Any, run: LoadRun, at: int) -> list[bool]:
        ex.host_pool(op.tier, op.slots)
        run.jobs.append((at, ex.outside.job(plane.rows, op.block_ids, op.slots, [plane.views[s] for s in op.slots])))
        oks = [True] * len(op.slots)
        if op.via:  # promoted from a lower DRAM tier: a memcpy into the upper tier's slots
            up = ex.host_pool(op.via_tier)
            copy_blocks([up.views[s] for s in op.via], [plane.views[s] for s in op.slots], ex.block_bytes)
            ex.report.stored(op.op_id, oks)
        return oks


class ReadLoad:
    """A lower tier's load: read into the promotion slots `op.via`, rows of its own (read ahead),
    the outside's own buffers, or staging rows; each block verified; then its copy into the
    outside goes to `run.jobs`, or runs chunk by chunk as each chunk's reads land."""

    stages = True
    reads_ahead = False

    def check(self, op: LoadOp, n: int) -> None:
        """What the op must carry for this medium's reads."""

    def note(self, ex: Any, op: LoadOp, lo: int, r: IOResult, corrupt: list[int]) -> None:
        """A chunk's failures, from `op.slots[lo]` on."""

    def load(self, ex: Any, op: LoadOp, plane: DataPlane, run: LoadRun, at: int) -> list[bool]:
        n = len(op.slots)
        self.check(op, n)
        pre = ex.take_read_ahead(op)
        direct = None
        if pre is not None:  # read ahead (an asynchronous load)
            host, rows, bufs, h = pre
            reads = [(0, h)]
        else:
            if op.via:
                pool = ex.host_pool(op.via_tier)
                host, rows, bufs = pool.rows, list(op.via), [pool.views[s] for s in op.via]
            elif ex.outside.direct_reads:
                direct = ex.outside.direct(op.block_ids)
                host, rows, bufs = None, list(range(n)), direct
            else:
                r0 = run.row0
                host, rows, bufs = ex.staging.rows(), list(range(r0, r0 + n)), run.stage[r0:r0 + n]
            step = max(1, ex.LOAD_CHUNK_BYTES // ex.block_bytes) if run.copy_now else n
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
            self.note(ex, op, lo, r, corrupt)
            good = [lo + i for i, ok in enumerate(r.ok) if ok]
            if good and direct is None:
                job = ex.outside.job(host, [op.block_ids[i] for i in good], [rows[i] for i in good],
                                     [bufs[i] for i in good])
                if not run.copy_now:
                    run.jobs.append((at, job))
                else:  # this chunk now; a failed copy fails its blocks, the other chunks' reads go on
                    try:
                        ex.copy_now([job])
                    except Exception as e:  # noqa: BLE001 - load errors
                        ex.count(Metric.LOAD_COPY_FAILED.key)
                        ex.once(("load_copy", ex.name(op.tier)) + cause(e), logging.ERROR,
                                "kvtier: copying %d blocks of %s into the KV failed: %s (load errors, "
                                "recomputed)", len(good), op.req_id, e)
                        ok = [False] * len(ok)
            oks.extend(ok)
        if corrupt:
            ex.count(Metric.CORRUPT_BLOCKS.at(ex.name(op.tier)), len(corrupt))
            ex.report.corrupt(op.tier, corrupt)
            ex.once(("corrupt", op.tier), logging.ERROR, "kvtier: %d blocks of %s from %s failed verification; "
                    "reported (recomputed, quarantined): %s", len(corrupt), op.req_id, ex.name(op.tier), errors[:2])
        if op.via:
            ex.report.stored(op.op_id, read_oks)
        return oks


class FileLoad(ReadLoad):
    pair = (FILE, OUTSIDE)

    def check(self, op: LoadOp, n: int) -> None:
        if op.checksums is None or len(op.checksums) != n:
            raise RuntimeError("file load without expected checksums")

    def note(self, ex: Any, op: LoadOp, lo: int, r: IOResult, corrupt: list[int]) -> None:
        """Failed verification: reported, the controller quarantines the slots."""
        corrupt.extend(op.slots[lo + i] for i, b in enumerate(r.bad) if b)


class SharedLoad(ReadLoad):
    pair = (SHARED, OUTSIDE)
    reads_ahead = True    # asynchronous loads start their GETs at once (`read_ahead`)

    def check(self, op: LoadOp, n: int) -> None:
        if not op.keys or len(op.keys) != n:
            raise RuntimeError("shared-tier load without keys")

    def note(self, ex: Any, op: LoadOp, lo: int, r: IOResult, corrupt: list[int]) -> None:
        """Absent (the server evicted it) or failed verification (`bad`): a miss, reported."""
        ex.report.shared_misses([op.keys[lo + i] for i, ok in enumerate(r.ok) if not ok],
                                [op.keys[lo + i] for i, b in enumerate(r.bad) if b])

    def read_ahead(self, ex: Any, op: LoadOp, plane: DataPlane) -> tuple:
        """Start the op's reads into its promotion slots or rows of its own: (host, rows, buffers,
        handle), taken back by `load`."""
        n = len(op.keys or [])
        try:
            if op.via:
                pool = ex.host_pool(op.via_tier, op.via)
                host, rows = pool.rows, list(op.via)
            else:
                host, rows = torch.empty((n, ex.block_bytes), dtype=torch.uint8, pin_memory=ex.pinned_rows()), [*range(n)]
            bufs = [host[r] for r in rows]
            h = plane.read(op.slots, bufs, op.keys)
        except Exception as e:  # noqa: BLE001 - a miss, reported with the load
            ex.once(("remote_read",) + cause(e), logging.WARNING,
                    "kvtier: shared-tier read of %d blocks for %s failed: %s", n, op.req_id, e)
            host, rows, bufs = None, [], []
            h = DoneHandle(IOResult(ok=[False] * n, errors=[str(e)]))
        return host, rows, bufs, h


# ---- stores: the caller's blocks -> DRAM slots -------------------------------------------------
class HostStore:
    pair = (OUTSIDE, HOST)

    def store(self, ex: Any, ops: Sequence[StoreOp], tainted: bool, failed: set[tuple[int, int]],
              defer: bool = False) -> tuple[list[tuple[StoreOp, Any]], Any]:
        """All in one batch; returns the (op, job)s stored and, with `defer` on a device, the
        event their copies complete at (else None: done); adds the failed slots."""
        planned: list[tuple[StoreOp, Any]] = []
        for op in ops:
            try:
                if tainted:
                    raise RuntimeError("a load failed this step")
                pool = ex.host_pool(op.tier, op.slots)
                planned.append((op, ex.outside.job(pool.rows, op.block_ids, op.slots,
                                                   [pool.views[s] for s in op.slots])))
            except Exception as e:  # noqa: BLE001 - this op fails, the others run
                ex.store_failed(op, e, tainted, failed)
        ev = None
        if planned:
            try:
                fault_point("store_copy")
                ev = ex.outside.store_async([j for _, j in planned])
                if not defer:
                    ex.outside.sync(ev)
                    ev = None
            except Exception as e:  # noqa: BLE001
                for op, _ in planned:
                    ex.store_failed(op, e, False, failed)
                planned, ev = [], None
        return planned, ev


# ---- copies down: DRAM -> a lower tier -----------------------------------------------------------
class HostCopy:
    pair = (HOST, HOST)
    order = 0

    def copy(self, down: Any, ops: list[CopyOp], failed: set) -> None:
        """A memcpy, done at once."""
        ex = down.ex
        for op in ops:
            try:
                src, dst = ex.host_pool(op.src_tier, op.src_slots), ex.host_pool(op.tier, op.slots)
                copy_blocks([dst.views[s] for s in op.slots], [src.views[s] for s in op.src_slots], ex.block_bytes)
            except Exception as e:  # noqa: BLE001
                down.copy_failed([op], e)
                continue
            ex.report.copied(op.op_id, [-1 if (op.src_tier, s) in failed else 0 for s in op.src_slots])
            n = len(op.slots)
            ex.count(Metric.BYTES_STORED.at(ex.name(op.tier)), n * ex.block_bytes)
            ex.count(Metric.BLOCKS_STORED.at(ex.name(op.tier)), n)


class BehindCopy:
    """Writes handed to the data plane now, waited for (and made durable) behind the step."""

    def behind(self, down: Any) -> Any:
        """The `WriteBehind` queue of this medium."""
        raise NotImplementedError

    def copy(self, down: Any, ops: list[CopyOp], failed: set) -> None:
        ex, behind = down.ex, self.behind(down)
        # a source slot whose store failed holds stale bytes: never written anywhere, not even to a
        # slot the index will not take (`fsck --rebuild` indexes what the block headers say)
        stale = [op for op in ops if any((op.src_tier, s) in failed for s in op.src_slots)]
        if stale:
            down.copy_failed(stale, None)
        ops = [op for op in ops if op not in stale]
        batch: list = []
        try:
            srcs = [[ex.host_pool(op.src_tier, op.src_slots).views[s] for s in op.src_slots] for op in ops]
            for op, views in zip(ops, srcs):  # every check before the first transfer is handed over
                batch.append((op, ex.plane_of(op.tier).write(op.slots, views, op.keys)))
        except Exception as e:  # noqa: BLE001 - the copies not handed over are dropped
            started = {id(b[0]) for b in batch}
            down.copy_failed([op for op in ops if id(op) not in started], e)
        if batch:
            behind.submit(ex.steps, ex.plane_of(batch[0][0].tier), batch, {s for t, s in failed})
            if behind.lag == 0:
                down.reap(wait=True)


class SharedCopy(BehindCopy):
    pair = (HOST, SHARED)
    order = 1

    def behind(self, down: Any) -> Any:
        return down.puts


class FileCopy(BehindCopy):
    pair = (HOST, FILE)
    order = 2

    def behind(self, down: Any) -> Any:
        return down.writes


HANDLERS: dict[tuple[Medium, Medium], Any] = {
    h.pair: h for h in (HostLoad(), FileLoad(), SharedLoad(), HostStore(), HostCopy(), SharedCopy(), FileCopy())}


def handler(src: Medium, dst: Medium) -> Any:
    """The handler of (src, dst); RuntimeError naming the pair when there is none."""
    h = HANDLERS.get((src, dst))
    if h is None:
        raise RuntimeError(f"no handler moves blocks from {src.value} to {dst.value}")
    return h
