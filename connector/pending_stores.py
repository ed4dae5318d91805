"""A worker's stores whose device copies are still running, reported in a later step.

`wait_for_save` queues a step's GPU -> CPU copies on the side stream and returns (no host wait).
Each step's hooks poll the oldest stores' events (`Streams.query`); once one completed, its
stores are reported stored (the scheduler commits them from that step's report) and the copies
down held behind it (NVMe writes with their checksums, shared-tier puts: they read the CPU slots)
start. A store whose event reports an error is not stored and its copies down are dropped, so
nothing of it is committed. At shutdown `drain` waits (bounded) and drops what is left, counted.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from kvtier.common.once import cause
from kvtier.common.counters import Metric

log = logging.getLogger("kvtier.connector")


@dataclass
class _Pending:
    planned: list                      # (StoreOp, job) pairs whose copies the event covers
    event: Any
    t0: float
    copies: list = field(default_factory=list)     # copies down that read these slots: start after
    failed: set = field(default_factory=set)       # (tier, slot) whose store failed in their step


class PendingStores:
    """Oldest first; the side stream runs them in order, so only a completed prefix is reported."""

    def __init__(self, ex: Any) -> None:
        self.ex = ex
        self.q: list[_Pending] = []

    def __len__(self) -> int:
        return len(self.q)

    def add(self, deferred: tuple | None) -> None:
        """The executor's last deferred store (`Executor.take_deferred`), if any."""
        if deferred is not None:
            self.q.append(_Pending(*deferred))

    def copying(self) -> set[int]:
        """Op ids of the stores still copying."""
        return {op.op_id for p in self.q for op, _ in p.planned}

    def hold(self, copies: list, failed: set) -> bool:
        """Copies down of this step: held behind the newest pending store (they may read its
        slots); False when nothing is pending (they may start now)."""
        if not self.q:
            return False
        self.q[-1].copies.extend(copies)
        self.q[-1].failed |= failed
        return True

    def poll(self) -> int:
        """Report the stores whose copies completed (oldest first); returns how many remain."""
        ex = self.ex
        while self.q:
            p = self.q[0]
            try:
                if not ex.outside.done(p.event):
                    break
            except Exception as e:  # noqa: BLE001 - the copies failed: nothing of them is committed
                self.q.pop(0)
                ex.count(Metric.STORE_COPY_FAILED.key, len(p.planned))
                ex.once(("store_event",) + cause(e), logging.ERROR, "kvtier: a store's device copies failed (%s): "
                        "not stored, its copies down dropped", e)
                ex.copy(p.copies, p.failed | ex.store_lost(p.planned, e))
                continue
            self.q.pop(0)
            ex.store_done(p.planned, time.perf_counter() - p.t0)
            ex.copy(p.copies, p.failed)
        return len(self.q)

    def drain(self, timeout_s: float) -> int:
        """Wait up to `timeout_s` for every pending store (polling); those still running are
        dropped (not stored, their copies down not started) and counted; returns how many."""
        deadline = time.monotonic() + timeout_s
        while self.poll() and time.monotonic() < deadline:
            time.sleep(0.001)
        if not self.q:
            return 0
        ex, late, self.q = self.ex, self.q, []
        n = sum(len(op.slots) for p in late for op, _ in p.planned)
        ex.count(Metric.STORES_DROPPED.key, n)
        log.error("kvtier: %d stores (%d blocks) still copying after %.1f s (closing): dropped, not stored",
                  len(late), n, timeout_s)
        for p in late:
            ex.store_lost(p.planned, RuntimeError("still copying at shutdown"))
            ex.fail_stores([], p.copies)
        return len(late)
