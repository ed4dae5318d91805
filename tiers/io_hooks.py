"""Test hooks: deterministic faults and crash points, from the environment.

KVTIER_FAULT=<point>:<kind>:N  fails the N-th and every later pass through <point>:
    write:EIO|ENOSPC|short:N   data-file writes (pwritev calls; short: the call moves half its
                               bytes, then fails with ENOSPC)
    fsync:EIO:N                fdatasyncs
    read:EIO:N                 data-file reads (preadv calls / kvikio preads): their blocks fail
                               (any errno name: EISDIR, ENOENT, ...)
    load_copy:error:N          queuings of a load's copies into vLLM's KV (a batch, or one request's
                               copies on the retry after a batch failed)
    store_copy:error:N         queuings of a step's KV -> DRAM copies
    layer_wait:error:N         waits of the forward for a layer's loaded blocks
    Each injected fault logs one WARNING line naming its point.
KVTIER_CRASH_AT=data_write:N | index_commit:N | fsync:N
    SIGKILL this process right after the N-th data write, before the N-th index commit,
    or during (before) the N-th fdatasync (KVTIER_CRASH_SIGNAL=INT / TERM sends that instead).
"""

from __future__ import annotations

import errno as _errno
import logging
import os
import threading

log = logging.getLogger("kvtier.faults")

FAULT_POINTS = ("write", "fsync", "read", "load_copy", "store_copy", "layer_wait")


class InjectedFault(RuntimeError):
    """A failure KVTIER_FAULT asked for (kind `error`)."""


class _Hooks:
    """Fault injection and crash points (see the module docstring), read once per process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: dict[str, int] = {}
        self.fault = self._parse(os.environ.get("KVTIER_FAULT", ""), 3)
        if self.fault and self.fault[0] not in FAULT_POINTS:
            raise ValueError(f"bad test hook KVTIER_FAULT={os.environ['KVTIER_FAULT']!r}: point "
                             f"{self.fault[0]!r} is not one of {', '.join(FAULT_POINTS)}")
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


def fault_point(point: str) -> None:
    """Count a pass through `point`; from the N-th pass KVTIER_FAULT names on, raise its fault
    (`error`: InjectedFault; an errno name such as EIO: that OSError) after one log line."""
    f = HOOKS.fault
    if f is None or f[0] != point:
        return
    n = HOOKS.tick(point)
    kind = HOOKS.fault_for(point, n)
    if kind is None:
        return
    log.warning("kvtier: injected fault at %s (pass %d, KVTIER_FAULT=%s:%s:%d)", point, n, *f)
    if kind == "error":
        raise InjectedFault(f"injected fault at {point} (pass {n})")
    code = getattr(_errno, kind, _errno.EIO)
    raise OSError(code, f"{os.strerror(code)} (injected at {point}, pass {n})")
