"""How long lazy offload keeps vLLM stepping to write finished requests behind (idle, and at shutdown).

Deadlines here count seconds of stepping, read once a step and each step counted at most
`STEP_MAX_S`: a stall of the engine or a jump of the clock between two steps costs one short
step, never the whole budget, so work queued before a stall is still written after it.
"""

from __future__ import annotations

import signal
import time
from typing import Any, Callable


class DrainBudget:
    """Idle steps keep coming while work is left and the last `limit_s` seconds of stepping made
    progress (less work than the step before); after a SIGTERM (`stop_in`) also only within the
    seconds vLLM's shutdown timeout leaves. `clock`: injectable for tests (monotonic by default)."""

    STEP_MAX_S = 0.5   # seconds one step counts at most: a stall or a clock jump is one step

    def __init__(self, limit_s: float, clock: Callable[[], float] | None = None) -> None:
        self.limit_s = limit_s
        self.clock = clock
        self.spent = 0.0                  # seconds of stepping without progress
        self.stop_left: float | None = None   # seconds of stepping left after a SIGTERM
        self.stop_budget: float | None = None  # ... what the SIGTERM left
        self._prev: float | None = None
        self._work: int | None = None

    def _now(self) -> float:
        return self.clock() if self.clock is not None else time.monotonic()

    def busy(self) -> None:
        """A step that scheduled a request: the idle budget starts again."""
        self.spent, self._work, self._prev = 0.0, None, self._now()

    def step(self, work: int) -> None:
        """One step with `work` blocks left to write (queued or in flight)."""
        now = self._now()
        dt = 0.0 if self._prev is None else min(max(0.0, now - self._prev), self.STEP_MAX_S)
        self._prev = now
        if self.stop_left is not None:
            self.stop_left -= dt
        if self._work is not None and work < self._work:
            self.spent = 0.0
        else:
            self.spent += dt
        self._work = work

    def stop_in(self, seconds: float) -> None:
        """Shutdown was asked: step on for at most `seconds` more."""
        self.stop_budget = self.stop_left = max(0.0, seconds)

    @property
    def open(self) -> bool:
        if self.stop_left is not None and self.stop_left <= 0:
            return False
        return self.spent < self.limit_s


def on_sigterm(callback: Callable[[], None]) -> bool:
    """Call `callback` on SIGTERM, then the handler already installed (vLLM's engine core: it
    starts its shutdown). Only where that handler is Python's (not the default, not ignored) and
    on the main thread; the callback must only set plain values (it runs inside a signal handler)."""
    try:
        prev = signal.getsignal(signal.SIGTERM)
        if not callable(prev):
            return False

        def handler(signum, frame):
            try:
                callback()
            finally:
                prev(signum, frame)

        signal.signal(signal.SIGTERM, handler)
        return True
    except ValueError:  # not the main thread
        return False


def drain_at_sigterm(sched_of: Callable[[], Any], timeout_s: float | None, teardown_s: float) -> bool:
    """At SIGTERM the scheduler's lazy offload (`sched_of()`) steps on for vLLM's shutdown timeout
    less the teardown after the last step (`teardown_s`: the workers' flush, and a second)."""
    left = max(0.0, float(timeout_s or 0) - teardown_s - 1.0)

    def cb() -> None:
        s = sched_of()
        if s is not None:
            s.drain_within(left)
    return on_sigterm(cb)
