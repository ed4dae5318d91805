"""Block I/O engines for the NVMe tier: POSIX O_DIRECT on a thread pool, or kvikio (GDS).

An engine moves whole blocks between memory buffers (uint8 torch tensors) and fixed,
aligned offsets of a file it opened. Each block's I/O size is its length rounded up to
`ALIGN`; blocks at consecutive offsets are coalesced into one vectored syscall. Optional
per-block xxh3_64 checksums are computed (write) or verified (read) in the I/O threads.

Which engine runs, and any fallback (e.g. O_DIRECT refused -> buffered), is logged on
``kvtier.nvme`` and reported in `description` / `stats()`, never silent.
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import errno as _errno
import logging
import mmap
import os
import queue
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import xxhash

from .handles import DoneHandle, FutureHandle, IOHandle, IOResult

log = logging.getLogger("kvtier.nvme")

ALIGN = 4096
HEADER = 4096  # the block header page of a keyed write (see nvme_block)
MAX_IO_BYTES = 8 << 20  # bytes per preadv/pwritev call
_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
_os_open = os.open  # patch point for tests (simulate a filesystem that refuses O_DIRECT)

_xxh3 = xxhash.xxh3_64_intdigest
_ZEROS = memoryview(bytes(ALIGN))


# ---- test hooks: deterministic faults and crashes ------------------------------------------
class _Hooks:
    """Fault injection and crash points, from the environment (read once per process):

    KVTIER_FAULT=write:EIO:N | write:ENOSPC:N | write:short:N | fsync:EIO:N
        data-file writes (pwritev calls) / fdatasyncs number N and later fail that way
        (short: the call moves half its bytes, the next call fails with ENOSPC);
    KVTIER_CRASH_AT=data_write:N | index_commit:N | fsync:N
        SIGKILL this process right after the N-th data write, before the N-th index commit,
        or during (before) the N-th fdatasync (KVTIER_CRASH_SIGNAL=INT / TERM sends that instead).
    """

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


class _Gate:
    """Holds a batch's tasks until the batch is registered (`open`), or drops them (`cancel`)."""

    def __init__(self) -> None:
        self._ev = threading.Event()
        self._cancelled = False

    def open(self) -> None:
        self._ev.set()

    def cancel(self) -> None:
        self._cancelled = True
        self._ev.set()

    def run(self, fn, run):
        self._ev.wait()
        if self._cancelled:
            return IOResult(ok=[False] * len(run), errors=["cancelled: interrupted while being submitted"])
        return fn(run)


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

    def stats(self) -> dict:
        return {"engine": self.description}


def _flat(t: torch.Tensor) -> torch.Tensor:
    if t.dtype != torch.uint8:
        t = t.reshape(-1).view(torch.uint8)
    return t.reshape(-1) if t.dim() != 1 else t


def _check_buffers(offsets, buffers, length, codec=None, keys=None) -> list[torch.Tensor]:
    """The buffers as flat uint8 tensors, after checking counts, keys and sizes."""
    if len(offsets) != len(buffers):
        raise ValueError(f"{len(offsets)} offsets but {len(buffers)} buffers")
    if codec is not None and (keys is None or len(keys) != len(offsets)):
        raise ValueError("a keyed block write/read needs one key per block")
    flat = []
    for i, b in enumerate(buffers):
        t = _flat(b)
        if t.numel() < length:
            raise ValueError(f"buffer {i} holds {t.numel()} bytes, block length is {length}")
        flat.append(t)
    return flat


class _Bounce:
    """Page-aligned anonymous memory (mmap) as a uint8 tensor and a memoryview."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.mv = memoryview(self.mm)
        self.t = torch.frombuffer(self.mm, dtype=torch.uint8, count=nbytes)
        self.t.zero_()  # pre-touch


class PosixEngine(IOEngine):
    """`os.preadv`/`os.pwritev` on a thread pool; O_DIRECT with page-aligned buffers.

    Buffers that are not page-aligned CPU tensors whose length is a multiple of ALIGN go
    through the engine's own aligned bounce buffers. If O_DIRECT is refused at open (EINVAL,
    e.g. some tmpfs/overlay filesystems), files are opened buffered and the fallback is logged
    and kept in `description`.
    """

    name = "posix"

    def __init__(self, threads: int = 4, direct: bool | str = "auto", max_io_bytes: int = MAX_IO_BYTES) -> None:
        if threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {threads}")
        if max_io_bytes < ALIGN or max_io_bytes % ALIGN:
            raise ValueError(f"max_io_bytes must be a positive multiple of {ALIGN}, got {max_io_bytes}")
        if direct not in (True, False, "auto"):
            raise ValueError(f"direct must be True, False or 'auto', got {direct!r}")
        self.threads = threads
        self.want_direct = direct
        self.max_io_bytes = max_io_bytes
        self.fallback: str | None = None
        self._pool = cf.ThreadPoolExecutor(threads, thread_name_prefix="kvtier-io")
        self._bounces: queue.SimpleQueue[_Bounce] = queue.SimpleQueue()
        self._headers: queue.SimpleQueue[_Bounce] = queue.SimpleQueue()  # small: header pages only
        self._bounce_size = max_io_bytes
        self._lock = threading.Lock()
        self.syscalls = 0
        self.bounced_blocks = 0
        self.io_errors = 0  # failed batches (each logged by _failed)
        self._live: set[cf.Future] = set()  # submitted, not finished: `drain` waits for them
        self._opening: set[_Gate] = set()   # batches being submitted (their tasks wait at the gate)

    def drain(self) -> None:
        """Wait until every submitted transfer finished (before the caller frees its buffers,
        e.g. when unwinding from an interrupt with transfers still in flight). A batch whose
        submission was interrupted (a signal raised in the submitting thread) never starts."""
        with self._lock:
            live = list(self._live)
            opening, self._opening = list(self._opening), set()
        for g in opening:
            g.cancel()
        cf.wait(live)

    def _forget(self, fut: cf.Future) -> None:
        with self._lock:
            self._live.discard(fut)

    @property
    def mode(self) -> str:
        if self.want_direct is False:
            return "buffered"
        return "buffered" if self.fallback else "O_DIRECT"

    @property
    def description(self) -> str:
        d = f"posix-{'direct' if self.mode == 'O_DIRECT' else 'buffered'} (preadv/pwritev, {self.threads} threads"
        d += f", <= {self.max_io_bytes >> 20} MiB/syscall)"
        if self.fallback:
            d += f" [{self.fallback}]"
        return d

    def open(self, path: str, dir_fd: int | None = None, read_only: bool = False) -> EngineFile:
        flags = os.O_RDONLY if read_only else os.O_RDWR | os.O_CREAT
        if self.want_direct is not False:
            try:
                fd = _open_in(path, flags | os.O_DIRECT, dir_fd)
                return EngineFile(path, fd, True)
            except OSError as e:
                if self.want_direct is True or e.errno not in (_errno.EINVAL, _errno.EOPNOTSUPP):
                    raise OSError(e.errno, f"cannot open {path} with O_DIRECT: {e.strerror}", path) from None
                self.fallback = (f"O_DIRECT refused: {_errno.errorcode.get(e.errno, e.errno)} "
                                 f"({e.strerror}) on {path}; using buffered I/O")
                log.warning("nvme io: %s", self.fallback)
        fd = _open_in(path, flags, dir_fd)
        return EngineFile(path, fd, False)

    # ---- batching ----------------------------------------------------------------------
    def _plan(self, offsets: Sequence[int], stride: int) -> list[list[int]]:
        """Group block indices into runs of consecutive offsets, each <= max_io_bytes / IOV_MAX."""
        order = sorted(range(len(offsets)), key=offsets.__getitem__)
        per_run = max(1, min(self.max_io_bytes // stride, _IOV_MAX // 3))  # header + pad iovecs
        runs: list[list[int]] = []
        cur: list[int] = []
        for i in order:
            o = offsets[i]
            if o % ALIGN:
                raise ValueError(f"offset {o} is not {ALIGN}-aligned")
            if cur and (o != offsets[cur[-1]] + stride or len(cur) >= per_run):
                runs.append(cur)
                cur = []
            cur.append(i)
        if cur:
            runs.append(cur)
        # spread big single runs over the threads: split so every worker has work
        if len(runs) < self.threads:
            total = sum(len(r) for r in runs)
            want = max(1, -(-total // self.threads))
            split = []
            for r in runs:
                for j in range(0, len(r), want):
                    split.append(r[j:j + want])
            runs = split
        return runs

    def _get_bounce(self, need: int) -> _Bounce:
        try:
            b = self._bounces.get_nowait()
            if b.nbytes >= need:
                return b
        except queue.Empty:
            pass
        return _Bounce(max(need, self._bounce_size))

    def _get_headers(self, need: int) -> _Bounce:
        try:
            b = self._headers.get_nowait()
            if b.nbytes >= need:
                return b
        except queue.Empty:
            pass
        return _Bounce(max(need, 64 * HEADER))

    @staticmethod
    def _zero_copy(f: EngineFile, t: torch.Tensor, length: int) -> bool:
        """Whether `t` can be an iovec as is (else it goes through a bounce buffer)."""
        if t.device.type != "cpu" or not t.is_contiguous():
            return False
        return not f.direct or (length % ALIGN == 0 and t.data_ptr() % ALIGN == 0)

    def _submit(self, fn, runs, finish, nblocks: int) -> IOHandle:
        if not runs:
            return DoneHandle(finish(IOResult(ok=[])) if finish else IOResult(ok=[]))
        order = [i for r in runs for i in r]
        # An exception raised in this thread (SIGINT / SIGTERM) between a submit and its
        # registration would leave a task drain() does not wait for, writing from buffers the
        # caller then frees. So tasks wait at a gate opened once all are registered; drain()
        # cancels a gate still closed, and its tasks return without touching a buffer.
        gate = _Gate()
        with self._lock:
            self._opening.add(gate)
        futs = [self._pool.submit(gate.run, fn, r) for r in runs]
        with self._lock:
            self._live.update(futs)
            gate.open()                  # before it leaves `_opening`: drain never waits on a closed gate
            self._opening.discard(gate)
        for f in futs:
            f.add_done_callback(self._forget)

        def reorder(res: IOResult) -> IOResult:
            ok = [False] * nblocks
            for j, i in enumerate(order):
                ok[i] = res.ok[j]
            res.ok = ok
            return finish(res) if finish else res

        return FutureHandle(futs, reorder)

    def write(self, f, offsets, buffers, length, checksums=None, finish=None, codec=None, keys=None) -> IOHandle:
        bufs = _check_buffers(offsets, buffers, length, codec, keys)
        padded = round_up(length)
        hdr_n = HEADER if codec is not None else 0
        stride = hdr_n + padded
        fd = f.fd

        def run(idx: list[int]) -> IOResult:
            bounce = hdrs = None
            try:
                iov = []
                if hdr_n:
                    hdrs = self._get_headers(len(idx) * hdr_n)
                for k, i in enumerate(idx):
                    t = bufs[i]
                    if hdrs is not None:
                        iov.append(hdrs.mv[k * hdr_n:(k + 1) * hdr_n])
                    if self._zero_copy(f, t, length):
                        block = memoryview(t.numpy())[:length]
                        iov.append(block)
                        if padded != length:  # buffered file: keep later blocks at their slots
                            iov.append(_ZEROS[:padded - length])
                    else:
                        if bounce is None:
                            bounce = self._get_bounce(len(idx) * padded)
                        lo = k * padded
                        bounce.t[lo:lo + length].copy_(t[:length])
                        if padded != length:
                            bounce.t[lo + length:lo + padded].zero_()
                        block = bounce.mv[lo:lo + length]
                        iov.append(bounce.mv[lo:lo + padded])
                        with self._lock:
                            self.bounced_blocks += 1
                    if hdrs is not None:
                        c = codec.seal(hdrs.mv[k * hdr_n:(k + 1) * hdr_n], keys[i], block)
                    else:
                        c = _xxh3(block) if checksums is not None else 0
                    if checksums is not None:
                        checksums[i] = c
                _pwritev_all(fd, iov, offsets[idx[0]], f.path)
                with self._lock:
                    self.syscalls += 1
                return IOResult(ok=[True] * len(idx), nbytes=len(idx) * length)
            except OSError as e:
                with self._lock:
                    self.io_errors += 1
                return _failed("write", len(idx), offsets[idx[0]], f.path, e)
            finally:
                if bounce is not None:
                    self._bounces.put(bounce)
                if hdrs is not None:
                    self._headers.put(hdrs)

        return self._submit(run, self._plan(offsets, stride), finish, len(bufs))

    def read(self, f, offsets, buffers, length, expect=None, mismatched=None, finish=None, codec=None,
             keys=None) -> IOHandle:
        bufs = _check_buffers(offsets, buffers, length, codec, keys)
        if codec is not None and expect is None:
            raise ValueError("a keyed block read needs the expected tags")
        padded = round_up(length)
        hdr_n = HEADER if codec is not None else 0
        stride = hdr_n + padded
        fd = f.fd

        def run(idx: list[int]) -> IOResult:
            bounce = hdrs = None
            try:
                iov, views = [], []
                if hdr_n:
                    hdrs = self._get_headers(len(idx) * hdr_n)
                for k, i in enumerate(idx):
                    t = bufs[i]
                    if hdrs is not None:
                        iov.append(hdrs.mv[k * hdr_n:(k + 1) * hdr_n])
                    if self._zero_copy(f, t, length):
                        v = memoryview(t.numpy())[:length]
                        iov.append(v)
                        views.append((v, None))
                        if padded != length:
                            iov.append(memoryview(bytearray(padded - length)))
                    else:
                        if bounce is None:
                            bounce = self._get_bounce(len(idx) * padded)
                        lo = k * padded
                        iov.append(bounce.mv[lo:lo + padded])
                        views.append((bounce.mv[lo:lo + length], lo))
                        with self._lock:
                            self.bounced_blocks += 1
                _preadv_all(fd, iov, offsets[idx[0]], f.path)
                with self._lock:
                    self.syscalls += 1
                ok, errs = [], []
                for k, i in enumerate(idx):
                    view, lo = views[k]
                    why = None
                    if hdrs is not None:
                        why = codec.check(hdrs.mv[k * hdr_n:(k + 1) * hdr_n], keys[i], expect[i], view)
                    elif expect is not None:
                        got = _xxh3(view)
                        if got != expect[i]:
                            why = f"checksum mismatch: stored {expect[i]:016x}, read {got:016x}"
                    if why is not None:
                        if mismatched is not None:
                            mismatched[i] = True
                        errs.append(f"block at offset {offsets[i]} in {f.path} fails verification: {why}")
                    elif lo is not None:
                        bufs[i][:length].copy_(bounce.t[lo:lo + length])
                    ok.append(why is None)
                return IOResult(ok=ok, nbytes=len(idx) * length, errors=errs)
            except OSError as e:
                with self._lock:
                    self.io_errors += 1
                return _failed("read", len(idx), offsets[idx[0]], f.path, e)
            finally:
                if bounce is not None:
                    self._bounces.put(bounce)
                if hdrs is not None:
                    self._headers.put(hdrs)

        return self._submit(run, self._plan(offsets, stride), finish, len(bufs))

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        while True:
            try:
                b = self._bounces.get_nowait()
            except queue.Empty:
                break
            del b

    def stats(self) -> dict:
        return {"engine": self.description, "io_mode": self.mode, "io_threads": self.threads,
                "syscalls": self.syscalls, "bounced_blocks": self.bounced_blocks, "io_errors": self.io_errors,
                "fallback": self.fallback}


def _open_in(path: str, flags: int, dir_fd: int | None) -> int:
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


def _failed(what: str, n: int, offset: int, path: str, e: OSError) -> IOResult:
    """A batch that failed with `e`: every block not ok, the cause logged and kept."""
    name = _errno.errorcode.get(e.errno, str(e.errno)) if e.errno else "?"
    msg = f"{what} of {n} blocks at offset {offset} in {path}: [{name}] {e.strerror}"
    log.error("nvme io: %s", msg)
    return IOResult(ok=[False] * n, errors=[msg])


def _all(syscall, fd: int, iov: list, off: int, short: str) -> None:
    """pwritev/preadv until every byte of `iov` moved (short transfers resumed; 0 bytes is EIO)."""
    total = sum(len(v) for v in iov)
    done = 0
    while True:
        n = syscall(fd, iov, off + done)
        done += n
        if done >= total:
            return
        if n == 0:
            raise OSError(_errno.EIO, f"short {short} ({done} of {total} bytes)")
        iov = _advance(iov, n)


def _pwritev_all(fd: int, iov: list, off: int, path: str = "?") -> None:
    if HOOKS.fault or HOOKS.crash:
        _pwritev_hooked(fd, iov, off, path)
        return
    _all(os.pwritev, fd, iov, off, "write")


def _pwritev_hooked(fd: int, iov: list, off: int, path: str) -> None:
    n = HOOKS.tick("write")
    fault = HOOKS.fault_for("write", n)
    if fault == "short":
        total = sum(len(v) for v in iov)
        half = total // 2 // ALIGN * ALIGN
        if half:
            os.pwritev(fd, _advance_to(iov, half), off)
        raise OSError(_errno.ENOSPC, f"short write ({half} of {total} bytes), then no space (injected)")
    if fault:
        code = getattr(_errno, fault)
        raise OSError(code, f"{os.strerror(code)} (injected)")
    _all(os.pwritev, fd, iov, off, "write")
    crash_point("data_write")


def _advance_to(iov: list, n: int) -> list:
    """The first `n` bytes of `iov`."""
    out = []
    for v in iov:
        if n <= 0:
            break
        out.append(v[:n])
        n -= len(v)
    return out


def _preadv_all(fd: int, iov: list, off: int, path: str) -> None:
    _all(os.preadv, fd, iov, off, f"read; file {path} truncated?")


def _advance(iov: list, n: int) -> list:
    out = []
    for v in iov:
        if n >= len(v):
            n -= len(v)
            continue
        out.append(v[n:] if n else v)
        n = 0
    return out


# ---- kvikio (GPUDirect Storage) ----------------------------------------------------------
def cuda_driver_reason() -> str | None:
    """None when a CUDA driver (libcuda.so.1) loads; otherwise why not."""
    try:
        ctypes.CDLL("libcuda.so.1")
        return None
    except OSError as e:
        return f"no CUDA driver ({e})"


BUFFERS = ("host", "device")
AUTO_HOST_REASON = ("io=auto: NVMe I/O moves host buffers (CPU pool, staging rows), which kvikio would "
                    "only move with buffered POSIX calls, no GDS; using POSIX")
KVIKIO_HOST_NOTE = "host buffers: kvikio's buffered POSIX path, no GDS"

_STRERRORS: dict[str, int] = {}


def _errno_of(e: BaseException) -> int | None:
    """The errno of `e`: its own (OSError), or the one whose message kvikio's text carries."""
    if isinstance(e, OSError) and e.errno:
        return e.errno
    if not _STRERRORS:
        _STRERRORS.update({os.strerror(n): n for n in sorted(_errno.errorcode, reverse=True)})
    msg = str(e)
    hits = [(len(s), n) for s, n in _STRERRORS.items() if s in msg]
    return max(hits)[1] if hits else None


def _error_kind(op: str, e: BaseException) -> tuple[str, int | None]:
    """('write RuntimeError [ENOENT] libcuda.so.1: ...', errno): the kind an error is counted and
    logged once under (kvikio's "KvikIO failure at: FILE:LINE:" prefix dropped)."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if msg.startswith("KvikIO failure at:"):
        parts = msg.split(": ", 2)
        msg = parts[2] if len(parts) == 3 else msg
    en = _errno_of(e)
    name = f" [{_errno.errorcode.get(en, en)}]" if en else ""
    return f"{op} {type(e).__name__}{name}: {msg[:200]}", en


def _kvikio_compat(kvikio) -> str:
    """kvikio's compat mode setting (ON: POSIX I/O in kvikio's threads, OFF: cuFile, AUTO)."""
    d = getattr(kvikio, "defaults", None)
    if d is None:
        try:
            import importlib  # noqa: PLC0415
            d = importlib.import_module("kvikio.defaults")  # a submodule kvikio does not import itself
        except Exception:  # noqa: BLE001
            return "unknown"
    for get in (lambda: d.get("compat_mode"), lambda: d.compat_mode()):  # kvikio >= 25 / older
        try:
            v = get()
            return getattr(v, "name", str(v))
        except Exception:  # noqa: BLE001 - a missing or renamed setting
            continue
    return "unknown"


def _reopen_path(fd: int, path: str) -> str:
    """A path that opens exactly the file `fd` refers to (its /proc magic link), else `path`."""
    p = f"/proc/self/fd/{fd}"
    return p if os.path.exists(p) else path


def _same_file(fd: int, other: int, path: str) -> None:
    a, b = os.fstat(fd), os.fstat(other)
    if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
        from .nvme_block import UnsafePath
        raise UnsafePath(_errno.ESTALE, f"data file {path}: kvikio opened another file than the one kvtier "
                         f"checked (device/inode {b.st_dev}/{b.st_ino}, not {a.st_dev}/{a.st_ino}); refused", path)


class KvikioEngine(IOEngine):
    """kvikio CuFile pread/pwrite, one task per block.

    CUDA tensors go straight to the file (GDS, or kvikio's own bounce buffers). Host tensors are
    handed to kvikio as numpy views (kvikio takes host memory through the buffer protocol, which
    torch CPU tensors lack); kvikio moves them with buffered POSIX calls. The file kvikio opens
    is the one `open` checked (O_NOFOLLOW in the directory, owner): kvikio reopens it through
    /proc/self/fd/N and its descriptor must name the same device and inode. Every failed
    transfer is counted (`io_errors`, by kind in `stats()`) and each kind is logged once.
    Needs `kvikio` and a CUDA driver; constructing it without either raises EngineUnavailable.
    Checksums are computed on host bytes (GPU buffers are copied for hashing only).
    """

    name = "kvikio"
    MAX_ERROR_KINDS = 64  # distinct kinds kept in stats (all are counted in io_errors)

    def __init__(self, threads: int = 4) -> None:
        why = cuda_driver_reason()
        if why:
            raise EngineUnavailable(f"kvikio engine unusable: {why}")
        try:
            import kvikio  # noqa: PLC0415 - optional extra, imported lazily
        except Exception as e:  # ImportError or a broken install
            raise EngineUnavailable(f"kvikio engine unusable: import kvikio failed: {e!r}") from None
        self._kvikio = kvikio
        self.threads = threads
        self._pool = cf.ThreadPoolExecutor(threads, thread_name_prefix="kvtier-kvikio")
        self.compat = _kvikio_compat(kvikio)
        self._lock = threading.Lock()
        self.io_errors = 0
        self.error_kinds: dict[str, int] = {}

    @property
    def description(self) -> str:
        return f"kvikio {getattr(self._kvikio, '__version__', '?')} (compat_mode={self.compat})"

    def open(self, path: str, dir_fd: int | None = None, read_only: bool = False) -> EngineFile:
        fd = _open_in(path, os.O_RDONLY if read_only else os.O_RDWR | os.O_CREAT, dir_fd)  # checks, fdatasync
        handle = None
        try:
            try:
                handle = self._kvikio.CuFile(_reopen_path(fd, path), "r" if read_only else "r+")
            except Exception as e:  # kvikio raises RuntimeError for what open(2) refused
                en = _errno_of(e) or _errno.EIO
                raise OSError(en, f"kvikio cannot open {path}: {e}", path) from None
            _same_file(fd, handle.fileno(), path)
        except BaseException:
            if handle is not None:
                handle.close()
            os.close(fd)
            raise
        return EngineFile(path, fd, True, handle)

    def _error(self, op: str, e: BaseException, f: EngineFile, offset: int) -> IOResult:
        """Count a failed block transfer; log its kind the first time it is seen."""
        kind, en = _error_kind(op, e)
        with self._lock:
            self.io_errors += 1
            first = kind not in self.error_kinds
            if first and len(self.error_kinds) >= self.MAX_ERROR_KINDS:
                kind = f"{op} (other kinds)"
                first = kind not in self.error_kinds
            self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1
        msg = f"kvikio {op} at offset {offset} in {f.path}: {e}"
        if first:
            log.error("nvme io: %s (errno %s; further errors of this kind are only counted)",
                      msg, _errno.errorcode.get(en, en) if en else "unknown")
        return IOResult(ok=[False], errors=[msg])

    def _views(self, offsets, buffers, length, codec, keys) -> list[tuple[torch.Tensor, object]]:
        """(the block as a uint8 tensor, what kvikio is given) per buffer: numpy views of host
        tensors, CUDA tensors as they are."""
        for i, b in enumerate(buffers):
            if not b.is_contiguous():
                raise ValueError(f"buffer {i} is not contiguous (kvikio moves one memory range per block)")
        out = []
        for t in _check_buffers(offsets, buffers, length, codec, keys):
            t = t[:length]
            out.append((t, t.numpy() if t.device.type == "cpu" else t))
        return out

    def write(self, f, offsets, buffers, length, checksums=None, finish=None, codec=None, keys=None) -> IOHandle:
        bufs = self._views(offsets, buffers, length, codec, keys)
        hdr_n = HEADER if codec is not None else 0

        def run(i: int) -> IOResult:
            try:
                t, kv = bufs[i]
                if checksums is not None or codec is not None:
                    mv = memoryview(kv if t.device.type == "cpu" else t.cpu().numpy())
                    if codec is not None:
                        hdr = memoryview(bytearray(HEADER))
                        c = codec.seal(hdr, keys[i], mv)
                        if os.pwrite(f.fd, hdr, offsets[i]) != HEADER:
                            raise OSError(_errno.EIO, "short header write")
                    else:
                        c = _xxh3(mv)
                    if checksums is not None:
                        checksums[i] = c
                n = f.handle.pwrite(kv, length, offsets[i] + hdr_n).get()
                if n != length:
                    raise OSError(_errno.EIO, f"short write {n} of {length}")
                return IOResult(ok=[True], nbytes=length)
            except Exception as e:  # noqa: BLE001 - kvikio raises RuntimeError for I/O errors
                return self._error("write", e, f, offsets[i])

        return FutureHandle([self._pool.submit(run, i) for i in range(len(bufs))], finish)

    def read(self, f, offsets, buffers, length, expect=None, mismatched=None, finish=None, codec=None,
             keys=None) -> IOHandle:
        bufs = self._views(offsets, buffers, length, codec, keys)
        hdr_n = HEADER if codec is not None else 0

        def run(i: int) -> IOResult:
            try:
                t, kv = bufs[i]
                n = f.handle.pread(kv, length, offsets[i] + hdr_n).get()
                if n != length:
                    raise OSError(_errno.EIO, f"short read {n} of {length}")
                if expect is not None:
                    mv = memoryview(kv if t.device.type == "cpu" else t.cpu().numpy())
                    if codec is not None:
                        why = codec.check(os.pread(f.fd, HEADER, offsets[i]), keys[i], expect[i], mv)
                    else:
                        got = _xxh3(mv)
                        why = f"stored {expect[i]:016x}, read {got:016x}" if got != expect[i] else None
                    if why is not None:
                        if mismatched is not None:
                            mismatched[i] = True
                        return IOResult(ok=[False], nbytes=length, errors=[
                            f"block at offset {offsets[i]} in {f.path} fails verification: {why}"])
                return IOResult(ok=[True], nbytes=length)
            except Exception as e:  # noqa: BLE001 - kvikio raises RuntimeError for I/O errors
                return self._error("read", e, f, offsets[i])

        return FutureHandle([self._pool.submit(run, i) for i in range(len(bufs))], finish)

    def close_file(self, f: EngineFile) -> None:
        if f.handle is not None:
            f.handle.close()
            f.handle = None
        super().close_file(f)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def stats(self) -> dict:
        with self._lock:
            kinds = dict(self.error_kinds)
        return {"engine": self.description, "io_threads": self.threads, "compat_mode": self.compat,
                "io_errors": self.io_errors, "io_error_kinds": kinds}


def select_engine(io: str = "auto", threads: int = 4, direct: bool | str = "auto",
                  max_io_bytes: int = MAX_IO_BYTES, buffers: str = "host") -> tuple[IOEngine, str]:
    """Pick the I/O engine for transfers from/to `buffers` ('host' memory or CUDA 'device' memory).

    'posix': POSIX. 'kvikio': kvikio (EngineUnavailable where it cannot run; with host buffers it
    works but is kvikio's buffered POSIX path, said in the reason). 'auto': POSIX for host buffers
    (what the NVMe tier always moves); for device buffers kvikio when a CUDA driver and kvikio are
    present, else POSIX. Returns (engine, reason); the choice is logged.
    """
    if io not in ("auto", "posix", "kvikio"):
        raise ValueError(f"io must be 'auto', 'posix' or 'kvikio', got {io!r}")
    if buffers not in BUFFERS:
        raise ValueError(f"buffers must be one of {BUFFERS}, got {buffers!r}")
    if io == "kvikio" or (io == "auto" and buffers == "device"):
        try:
            eng = KvikioEngine(threads)
            reason = f"io={io}: CUDA driver present and kvikio imports"
            if buffers == "host":
                reason += f"; {KVIKIO_HOST_NOTE}"
            log.info("nvme io engine: %s (%s)", eng.description, reason)
            return eng, reason
        except EngineUnavailable as e:
            if io == "kvikio":
                raise
            reason = f"io=auto: {e}; using POSIX"
    elif io == "auto":
        reason = AUTO_HOST_REASON
    else:
        reason = "io=posix asked"
    eng = PosixEngine(threads, direct, max_io_bytes)
    log.info("nvme io engine: %s (%s)", eng.description, reason)
    return eng, reason
