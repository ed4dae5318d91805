"""Test hooks of the NVMe I/O path: deterministic faults and crash points, from the environment.

KVTIER_FAULT=write:EIO:N | write:ENOSPC:N | write:short:N | fsync:EIO:N
    data-file writes (pwritev calls) / fdatasyncs number N and later fail that way
    (short: the call moves half its bytes, the next call fails with ENOSPC);
KVTIER_CRASH_AT=data_write:N | index_commit:N | fsync:N
    SIGKILL this process right after the N-th data write, before the N-th index commit,
    or during (before) the N-th fdatasync (KVTIER_CRASH_SIGNAL=INT / TERM sends that instead).
"""

from __future__ import annotations

import os
import threading


class _Hooks:
    """Fault injection and crash points (see the module docstring), read once per process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: dict[str, int] = {}
        self.fault = self._parse(os.environ.get("KVTIER_FAULT", ""), 3)
        self.crash = self._parse(os.environ.get("KVTIER_CRASH_AT", ""), 2)

    @staticmethod
    def _parse(v: str, n: int) -> tuple | None:
        if not v:
            return None
        parts = v.split(":")
        if len(parts) != n or not parts[-1].isdigit():
            raise ValueError(f"bad test hook {v!r}")
        return tuple(parts[:-1]) + (int(parts[-1]),)

    def tick(self, point: str) -> int:
        with self.lock:
            c = self.counts[point] = self.counts.get(point, 0) + 1
        return c

    def crash_point(self, point: str, count: int) -> None:
        if self.crash and self.crash[0] == point and count == self.crash[1]:
            import signal
            os.kill(os.getpid(), getattr(signal, "SIG" + os.environ.get("KVTIER_CRASH_SIGNAL", "KILL")))

    def fault_for(self, what: str, count: int) -> str | None:
        f = self.fault
        return f[1] if f and f[0] == what and count >= f[2] else None


HOOKS = _Hooks()


def crash_point(point: str) -> None:
    """Count `point`; SIGKILL the process at the count KVTIER_CRASH_AT names (tests only)."""
    if HOOKS.crash and HOOKS.crash[0] == point:
        HOOKS.crash_point(point, HOOKS.tick("crash:" + point))
