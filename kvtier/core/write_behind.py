"""Write-behind of copies down (to a file, to the shared tier): the caller's step never waits for them.

`submit` takes a step's batch of writes already handed to the I/O engine; one flusher thread
waits for them, fdatasyncs the data file once and turns each op into per-slot tags (-1: not
durable, or its CPU source failed this step). `reap` returns the finished batches, waiting for
those `lag` steps old, so every write is reported (and then indexed by the controller) at the
latest `lag` steps after the step that queued it.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any, Callable

from kvtier.core.plan import CopyOp, ReportBuilder
from kvtier.core.planes import Planes
from kvtier.common.once import Once, cause
from kvtier.common.counters import Metric

Done = tuple[list[tuple[Any, list[int]]], float, list[str]]   # ([(op, per-slot tags)], seconds, errors)


class WriteBehind:
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


def _flush(nvme: Any, batch: list, failed_src: set[int], t0: float) -> Done:
    """The flusher thread: wait for a batch's writes, fdatasync once, per-op tags (-1: failed)."""
    try:
        results = [(op, h.wait()) for op, h in batch]
        if any(any(r.ok) for _, r in results):
            nvme.sync()
    except Exception as e:  # noqa: BLE001 - the batch is not durable: reported, the sources stay
        return [(op, [-1] * len(op.src_slots)) for op, _ in batch], time.perf_counter() - t0, [str(e)]
    out = [(op, [c if ok and src not in failed_src else -1
                 for c, ok, src in zip(r.tags or [0] * len(r.ok), r.ok, op.src_slots)]) for op, r in results]
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
                    n += sum(1 for c in out if c >= 0)
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
