"""The kvikio block I/O engine (GPUDirect Storage): the optional `kvtier[gds]` extra, imported lazily."""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import errno as _errno
import logging
import os
import threading

import torch
import xxhash

from .io_engine import FutureHandle, IOHandle, IOResult
from .io_engine import HEADER, EngineFile, EngineUnavailable, IOEngine, check_buffers, open_in
from .io_engine import fault_point

log = logging.getLogger("kvtier.nvme")

_xxh3 = xxhash.xxh3_64_intdigest


def cuda_driver_reason() -> str | None:
    """None when a CUDA driver (libcuda.so.1) loads; otherwise why not."""
    try:
        ctypes.CDLL("libcuda.so.1")
        return None
    except OSError as e:
        return f"no CUDA driver ({e})"


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
    can_encrypt = False  # device memory straight to the file: no host copy to encrypt
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
        fd = open_in(path, os.O_RDONLY if read_only else os.O_RDWR | os.O_CREAT, dir_fd)  # checks, fdatasync
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
        for t in check_buffers(offsets, buffers, length, codec, keys):
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
                fault_point("read")
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
