"""Write-behind of copies down (to a file, to the shared tier): the caller's step never waits for them.

`submit` takes a step's batch of writes already handed to the I/O engine; one flusher thread
waits for them, fdatasyncs the data file once and turns each op into per-slot tags (-1: not
durable, or its CPU source failed this step). `reap` returns the finished batches, waiting for
those `lag` steps old, so every write is reported (and then indexed by the controller) at the
latest `lag` steps after the step that queued it.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

Done = tuple[list[tuple[Any, list[int]]], float, list[str]]   # ([(op, per-slot tags)], seconds, errors)


class WriteBehind:
    def __init__(self, lag_steps: int) -> None:
        self.lag = max(0, int(lag_steps))
        self._pending: list[tuple[int, Future]] = []
        self._pool: ThreadPoolExecutor | None = None

    def __len__(self) -> int:
        return len(self._pending)

    def submit(self, step: int, nvme: Any, batch: list, failed_src: set[int]) -> None:
        """`batch`: (op, tags list the engine fills, write handle) per NVMe write op."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-nvme-flush")
        self._pending.append((step, self._pool.submit(_flush, nvme, batch, set(failed_src), time.perf_counter())))

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
        results = [(op, sums, h.wait()) for op, sums, h in batch]
        if any(any(r.ok) for _, _, r in results):
            nvme.sync()
    except Exception as e:  # noqa: BLE001 - the batch is not durable: reported, the sources stay
        return [(op, [-1] * len(op.src_slots)) for op, _, _ in batch], time.perf_counter() - t0, [str(e)]
    out = [(op, [c if ok and src not in failed_src else -1 for c, ok, src in zip(sums, r.ok, op.src_slots)])
           for op, sums, r in results]
    return out, time.perf_counter() - t0, [e for _, _, r in results for e in r.errors]
