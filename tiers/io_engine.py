"""The block I/O engine interface of the NVMe tier, and what every engine shares.

An engine moves whole blocks between memory buffers (uint8 torch tensors) and fixed,
aligned offsets of a file it opened. Each block's I/O size is its length rounded up to
`ALIGN`; optional per-block xxh3_64 checksums are computed (write) or verified (read) in the
I/O threads. The engines: `io_posix.PosixEngine`, `io_kvikio.KvikioEngine`; `io_engines.select_engine`
picks one. Every transfer returns a handle (`IOHandle`: poll with `done()`, block with `wait()`)
whose `IOResult` gives per-block outcomes; every data plane returns the same. The fault points
(`fault_point`, `crash_point`) are where tests inject I/O errors and crashes, from the environment.
"""

from __future__ import annotations

import concurrent.futures as cf
import errno as _errno
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

ALIGN = 4096
HEADER = 4096  # the block header page of a keyed write (see nvme_block)
MAX_IO_BYTES = 8 << 20  # bytes per preadv/pwritev call
_os_open = os.open  # patch point for tests (simulate a filesystem that refuses O_DIRECT)


def round_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


class EngineUnavailable(RuntimeError):
    """The asked-for I/O engine cannot run here (the message says why)."""


@dataclass
class EngineFile:
    """A file opened by an engine: `fd` (POSIX) or `handle` (kvikio CuFile)."""

    path: str
    fd: int
    direct: bool
    handle: object = None


class IOEngine:
    """Moves blocks between buffers and aligned file offsets; returns IOHandles."""

    name = "abstract"
    can_encrypt = True   # moves blocks through host memory, where `sealing` can encrypt them
    device_io = False    # moves device memory to and from the file itself (kvikio: GPUDirect Storage);
                         # a data file on such an engine writes block format 4 (`nvme_block`)
    mode: str | None = None  # kvikio's: "GDS" (cuFile) or "compatibility" (its POSIX path)

    @property
    def description(self) -> str:
        return self.name

    def open(self, path: str, dir_fd: int | None = None, read_only: bool = False) -> EngineFile:
        """Open (create unless `read_only`) the file; with `dir_fd`, `path`'s base name is opened
        inside that directory without following a symlink, and a file another user owns is refused."""
        raise NotImplementedError

    def write(self, f: EngineFile, offsets: Sequence[int], buffers: Sequence[torch.Tensor], length: int,
              checksums: list[int] | None = None,
              finish: Callable[[IOResult], IOResult] | None = None, codec=None,
              keys: Sequence[bytes] | None = None) -> IOHandle:
        """Write `length` bytes of each buffer at offsets[i]; fill checksums[i] (xxh3_64) if given.

        With `codec` (a `nvme_block.BlockCodec`) and `keys`, each block is a sealed header page
        then the payload, and checksums[i] receives the header's tag.
        """
        raise NotImplementedError

    def read(self, f: EngineFile, offsets: Sequence[int], buffers: Sequence[torch.Tensor], length: int,
             expect: Sequence[int] | None = None, mismatched: list[bool] | None = None,
             finish: Callable[[IOResult], IOResult] | None = None, codec=None,
             keys: Sequence[bytes] | None = None) -> IOHandle:
        """Read `length` bytes at offsets[i] into buffers[i].

        With `expect`, ok[i] is False when the bytes' xxh3_64 differs from expect[i] (with a
        `codec`: when the header does not verify for keys[i] with tag expect[i]), and
        mismatched[i] (if given) is set True, telling corruption apart from I/O errors.
        """
        raise NotImplementedError

    def sync(self, f: EngineFile) -> None:
        """fdatasync the file; a failure raises OSError naming the path and errno."""
        if HOOKS.crash or HOOKS.fault:
            crash_point("fsync")
            if HOOKS.fault_for("fsync", HOOKS.tick("fsync")):
                raise OSError(_errno.EIO, f"fdatasync {f.path}: [EIO] injected fault", f.path)
        try:
            os.fdatasync(f.fd)
        except OSError as e:
            raise OSError(e.errno, f"fdatasync {f.path}: [{_errno.errorcode.get(e.errno, e.errno)}] "
                          f"{e.strerror}", f.path) from None

    def close_file(self, f: EngineFile) -> None:
        if f.fd >= 0:
            os.close(f.fd)
            f.fd = -1

    def close(self) -> None:
        pass

    def drain(self) -> None:
        """Wait for every transfer in flight (engines that track them)."""

    def reserve(self, stride: int, blocks: int) -> None:
        """Make now (at open) the host buffers that an encrypted tier's transfers of up to `blocks`
        slots of `stride` bytes go through, rather than in its first transfer (engines that bounce)."""

    def stats(self) -> dict:
        return {"engine": self.description}


def flat(t: torch.Tensor) -> torch.Tensor:
    """`t` as a 1-D uint8 tensor over the same memory."""
    if t.dtype != torch.uint8:
        t = t.reshape(-1).view(torch.uint8)
    return t.reshape(-1) if t.dim() != 1 else t


def check_buffers(offsets, buffers, length, codec=None, keys=None) -> list[torch.Tensor]:
    """The buffers as flat uint8 tensors, after checking counts, keys and sizes."""
    if len(offsets) != len(buffers):
        raise ValueError(f"{len(offsets)} offsets but {len(buffers)} buffers")
    if codec is not None and (keys is None or len(keys) != len(offsets)):
        raise ValueError("a keyed block write/read needs one key per block")
    out = []
    for i, b in enumerate(buffers):
        t = flat(b)
        if t.numel() < length:
            raise ValueError(f"buffer {i} holds {t.numel()} bytes, block length is {length}")
        out.append(t)
    return out


def open_in(path: str, flags: int, dir_fd: int | None) -> int:
    """open(2) of `path` (0600), or of its base name inside `dir_fd` with O_NOFOLLOW and an owner check."""
    if dir_fd is None:
        return _os_open(path, flags | os.O_CLOEXEC, 0o600)
    from .nvme_block import UnsafePath, guard_file
    try:
        fd = _os_open(os.path.basename(path), flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == _errno.ELOOP:
            raise UnsafePath(e.errno, f"data file {path} is a symlink; refused", path) from None
        raise
    return guard_file(fd, path, "data file", writable=(flags & os.O_ACCMODE) != os.O_RDONLY)


# ---- handles: poll with done(), block with wait() ----------------------------------------------------
# Asynchronous I/O handles: poll with done(), block with wait().
@dataclass
class IOResult:
    """Per-block outcome of one batch: ok[i] is False for a block that failed or did not verify;
    bad[i] (when not empty) True for a block that was there but failed verification; tags[i]
    (a write, when the data plane seals blocks) the tag block i was written with."""

    ok: list[bool]
    nbytes: int = 0
    errors: list[str] = field(default_factory=list)
    bad: list[bool] = field(default_factory=list)
    tags: list = field(default_factory=list)

    @property
    def all_ok(self) -> bool:
        return all(self.ok)


class IOHandle:
    """A batch of block reads or writes in flight."""

    def done(self) -> bool:
        raise NotImplementedError

    def wait(self, timeout: float | None = None) -> IOResult:
        raise NotImplementedError


class DoneHandle(IOHandle):
    def __init__(self, result: IOResult) -> None:
        self._result = result

    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> IOResult:
        return self._result


class FutureHandle(IOHandle):
    """Handle over thread-pool futures, each returning an IOResult for a sub-batch, merged in order."""

    def __init__(self, futures: Sequence[cf.Future], finish: Callable[[IOResult], IOResult] | None = None) -> None:
        self._futures = list(futures)
        self._finish = finish
        self._result: IOResult | None = None

    def done(self) -> bool:
        return self._result is not None or all(f.done() for f in self._futures)

    def wait(self, timeout: float | None = None) -> IOResult:
        if self._result is None:
            merged = IOResult(ok=[])
            for f in self._futures:
                r = f.result(timeout)
                merged.ok.extend(r.ok)
                merged.nbytes += r.nbytes
                merged.errors.extend(r.errors)
                merged.bad.extend(r.bad or [False] * len(r.ok))
            if not any(merged.bad):
                merged.bad = []
            self._result = self._finish(merged) if self._finish else merged
        return self._result


# ---- fault points: deterministic faults and crash points, from the environment -----------------------
# Test hooks: deterministic faults and crash points, from the environment.
#
# KVTIER_FAULT=<point>:<kind>:N  fails the N-th and every later pass through <point>:
#     write:EIO|ENOSPC|short:N   data-file writes (pwritev calls; short: the call moves half its
#                                bytes, then fails with ENOSPC)
#     fsync:EIO:N                fdatasyncs
#     read:EIO:N                 data-file reads (preadv calls / kvikio preads): their blocks fail
#                                (any errno name: EISDIR, ENOENT, ...)
#     load_copy:error:N          queuings of a load's copies into vLLM's KV (a batch, or one request's
#                                copies on the retry after a batch failed)
#     store_copy:error:N         queuings of a step's KV -> DRAM copies
#     layer_wait:error:N         waits of the forward for a layer's loaded blocks
#     Each injected fault logs one WARNING line naming its point.
# KVTIER_CRASH_AT=data_write:N | index_commit:N | fsync:N
#     SIGKILL this process right after the N-th data write, before the N-th index commit,
#     or during (before) the N-th fdatasync (KVTIER_CRASH_SIGNAL=INT / TERM sends that instead).
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
