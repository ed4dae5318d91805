"""The POSIX block I/O engine: O_DIRECT `preadv`/`pwritev` on a thread pool.

Blocks at consecutive offsets are coalesced into one vectored syscall. Which mode runs, and
a fallback (O_DIRECT refused -> buffered), is logged on ``kvtier.nvme`` and reported in
`description` / `stats()`, never silent.
"""

from __future__ import annotations

import concurrent.futures as cf
import errno as _errno
import logging
import mmap
import os
import queue
import threading
from typing import Sequence

import torch
import xxhash

from kvtier.common.once import Once

from .io_engine import DoneHandle, FutureHandle, IOHandle, IOResult
from .io_engine import ALIGN, HEADER, MAX_IO_BYTES, EngineFile, IOEngine, check_buffers, open_in, round_up
from .io_engine import HOOKS, crash_point, fault_point
from .sealing import TAG_BYTES

log = logging.getLogger("kvtier.nvme")

_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
_xxh3 = xxhash.xxh3_64_intdigest
_ZEROS = memoryview(bytes(ALIGN))
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


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


class _Bounce:
    """Page-aligned anonymous memory (mmap) as a uint8 tensor and a memoryview, its pages made
    at once (MAP_POPULATE: one call, not a fault per page; anonymous pages are zeros)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE)
        self.mv = memoryview(self.mm)
        self.t = torch.frombuffer(self.mm, dtype=torch.uint8, count=nbytes)
        if not _POPULATE:
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
        self.buffers_made = 0  # bounce buffers made (at `reserve`, or in a transfer that found none free)
        self.io_errors = 0  # failed batches (counted always, each cause logged once by _failed)
        self._once = Once(log)
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
                fd = open_in(path, flags | os.O_DIRECT, dir_fd)
                return EngineFile(path, fd, True)
            except OSError as e:
                if self.want_direct is True or e.errno not in (_errno.EINVAL, _errno.EOPNOTSUPP):
                    raise OSError(e.errno, f"cannot open {path} with O_DIRECT: {e.strerror}", path) from None
                self.fallback = (f"O_DIRECT refused: {_errno.errorcode.get(e.errno, e.errno)} "
                                 f"({e.strerror}) on {path}; using buffered I/O")
                log.warning("nvme io: %s", self.fallback)
        fd = open_in(path, flags, dir_fd)
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
        with self._lock:
            self.buffers_made += 1
        return _Bounce(max(need, self._bounce_size))

    def reserve(self, stride: int, blocks: int) -> None:
        """One bounce per thread, each as large as a run of `blocks` slots needs (an encrypted
        run's ciphertext and tag scratch: `stride` bytes a block), made now."""
        n = max(1, min(self.max_io_bytes // stride, _IOV_MAX // 3, blocks)) * stride
        for _ in range(self.threads):
            self._bounces.put(_Bounce(n))
        self.buffers_made += self.threads

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
        bufs = check_buffers(offsets, buffers, length, codec, keys)
        padded = round_up(length)
        hdr_n = HEADER if codec is not None else 0
        stride = hdr_n + padded
        fd = f.fd
        sealed = codec is not None and codec.sealer is not None  # ciphertext (and its tag) in the bounce

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
                    if sealed:
                        if bounce is None:
                            bounce = self._get_bounce(len(idx) * (padded + ALIGN))
                        lo = k * (padded + ALIGN)
                        out = bounce.mv[lo:lo + length + TAG_BYTES]
                        if t.device.type == "cpu" and t.is_contiguous():
                            src = memoryview(t.numpy())[:length]
                        else:
                            bounce.t[lo:lo + length].copy_(t[:length])
                            src = out[:length]  # encrypted in place
                        c = codec.seal(hdrs.mv[k * hdr_n:(k + 1) * hdr_n], keys[i], src, out)
                        if padded != length:  # the tag scratch and the bounce's old bytes: not stored
                            bounce.t[lo + length:lo + padded].zero_()
                        iov.append(bounce.mv[lo:lo + padded])
                        if checksums is not None:
                            checksums[i] = c
                        continue
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
                return self._failed("write", len(idx), offsets[idx[0]], f.path, e)
            finally:
                if bounce is not None:
                    self._bounces.put(bounce)
                if hdrs is not None:
                    self._headers.put(hdrs)

        return self._submit(run, self._plan(offsets, stride), finish, len(bufs))

    def read(self, f, offsets, buffers, length, expect=None, mismatched=None, finish=None, codec=None,
             keys=None) -> IOHandle:
        bufs = check_buffers(offsets, buffers, length, codec, keys)
        if codec is not None and expect is None:
            raise ValueError("a keyed block read needs the expected tags")
        padded = round_up(length)
        hdr_n = HEADER if codec is not None else 0
        stride = hdr_n + padded
        fd = f.fd
        sealed = codec is not None and codec.sealer is not None  # read into the bounce, decrypted out of it

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
                    if sealed:
                        if bounce is None:
                            bounce = self._get_bounce(len(idx) * (padded + ALIGN))
                        lo = k * (padded + ALIGN)
                        iov.append(bounce.mv[lo:lo + padded])
                        views.append((bounce.mv[lo:lo + length + TAG_BYTES], lo))
                        continue
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
                        hdr = hdrs.mv[k * hdr_n:(k + 1) * hdr_n]
                        out = None  # sealed: decrypted out of the bounce, into the buffer when it can
                        if sealed and bufs[i].device.type == "cpu" and bufs[i].is_contiguous():
                            out, lo = memoryview(bufs[i].numpy())[:length], None  # (as a plain read, a block
                        why = (codec.check(hdr, keys[i], expect[i], view[:length])  # that fails leaves
                               or codec.unseal(hdr, keys[i], view, out))            # unspecified bytes)
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
                return self._failed("read", len(idx), offsets[idx[0]], f.path, e)
            finally:
                if bounce is not None:
                    self._bounces.put(bounce)
                if hdrs is not None:
                    self._headers.put(hdrs)

        return self._submit(run, self._plan(offsets, stride), finish, len(bufs))

    def _failed(self, what: str, n: int, offset: int, path: str, e: OSError) -> IOResult:
        """A batch that failed with `e`: every block not ok, counted in `io_errors`. Each cause
        (operation, errno, file) is logged once at ERROR, its repeats at DEBUG: a full or
        read-only disk fails every step."""
        name = _errno.errorcode.get(e.errno, str(e.errno)) if e.errno else "?"
        msg = f"{what} of {n} blocks at offset {offset} in {path}: [{name}] {e.strerror}"
        with self._lock:
            self.io_errors += 1
            self._once((what, e.errno, path), logging.ERROR,
                       "nvme io: %s (further %s failures with %s on this file are counted in io_errors)",
                       msg, what, name)
        return IOResult(ok=[False] * n, errors=[msg])

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
                "syscalls": self.syscalls, "bounced_blocks": self.bounced_blocks, "buffers_made": self.buffers_made,
                "io_errors": self.io_errors, "fallback": self.fallback}


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
    if HOOKS.fault:
        fault_point("read")
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
