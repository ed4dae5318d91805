"""The kvikio block I/O engine (GPUDirect Storage): the optional `kvtier[gds]` extra, imported lazily.

Device tensors (CUDA) move between the file and device memory through kvikio's CuFile: with
cuFile usable (kvikio's mode "GDS") by DMA, with no host copy; in kvikio's compatibility mode by
kvikio's own POSIX reads and bounce buffers. kvtier hands it device memory in two places: loads
without a promotion slot read into an outside's device staging rows (`FileLoad`), and stores into
an NVMe top tier write from them (`FileStore`, kvtier/core/handlers.py); copies down from DRAM
hand it host memory. Keyed blocks are format 4 (`nvme_block`): the
header page is read and written on the host (os.pread / os.pwrite), the payload's hash is
`block_sum.KeyedSum`, computed by torch on the payload's own device. A format-2 (xxh3) block
read into device memory is read and verified on the host, then copied to the device (counted
in `host_fallback_blocks`, logged once). Host tensors go through kvikio as numpy views
(kvikio's buffered POSIX path).
"""

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
from .nvme_block import DEVICE_VERSION, SEALED_VERSION

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


GDS, COMPAT = "GDS", "compatibility"


def kvikio_mode(kvikio, handle=None) -> str:
    """'GDS' (cuFile moves device memory to and from the file) or 'compatibility' (kvikio's POSIX
    I/O and bounce buffers), as kvikio says: an open `handle`'s own answer, else kvikio's
    (`is_compat_mode_preferred`, kvikio >= 24.12), else its compat_mode setting."""
    for owner in (handle, getattr(kvikio, "defaults", None)):
        pref = getattr(owner, "is_compat_mode_preferred", None)  # a kvikio binding, absent in older ones
        if callable(pref):
            try:
                return COMPAT if pref() else GDS
            except Exception:  # noqa: BLE001 - an older or broken binding: the setting decides
                pass
    setting = _kvikio_compat(kvikio).upper()
    if setting in ("ON", "TRUE", "1"):
        return COMPAT
    if setting in ("OFF", "FALSE", "0"):
        return GDS
    try:  # AUTO: kvikio uses cuFile when libcufile loads (and its driver opens)
        ctypes.CDLL("libcufile.so.0")
        return GDS
    except OSError:
        return COMPAT


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

    Device tensors (of `device_type`, CUDA; tests set "cpu" to drive this path on CPU tensors) go
    to kvikio as they are: GDS, or kvikio's own bounce buffers in its compatibility mode (`mode`).
    Keyed blocks of format 4 keep their payload off the host: header pages on the host, the
    payload hash computed by torch on the device. Host tensors are handed to kvikio as numpy
    views (kvikio takes host memory through the buffer protocol, which torch CPU tensors lack).
    Payload bytes of device transfers that did go through host memory (a format-2 block, an
    unkeyed xxh3 checksum) are counted in `host_payload_bytes`. The file kvikio opens is the one
    `open` checked (O_NOFOLLOW in the directory, owner): kvikio reopens it through
    /proc/self/fd/N and its descriptor must name the same device and inode. Every failed
    transfer is counted (`io_errors`, by kind in `stats()`) and each kind is logged once.
    Needs `kvikio` and a CUDA driver; constructing it without either raises EngineUnavailable.
    """

    name = "kvikio"
    can_encrypt = False  # device memory straight to the file: no host copy to encrypt
    device_io = True
    device_type = "cuda"
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
        self.mode = kvikio_mode(kvikio)
        self._lock = threading.Lock()
        self.io_errors = 0
        self.error_kinds: dict[str, int] = {}
        self.host_payload_bytes = 0     # device transfers' payload bytes that went through host memory
        self.host_fallback_blocks = 0   # format-2 blocks read into device memory through the host

    @property
    def description(self) -> str:
        return f"kvikio {getattr(self._kvikio, '__version__', '?')} ({self.mode}; compat_mode={self.compat})"

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
        self.mode = kvikio_mode(self._kvikio, handle)  # the handle knows whether cuFile took the file
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

    def _views(self, offsets, buffers, length, codec, keys) -> list[tuple[torch.Tensor, object, bool]]:
        """(the block as a uint8 tensor, what kvikio is given, whether it is device memory) per
        buffer: numpy views of host tensors, device tensors as they are."""
        for i, b in enumerate(buffers):
            if not b.is_contiguous():
                raise ValueError(f"buffer {i} is not contiguous (kvikio moves one memory range per block)")
        out = []
        for t in check_buffers(offsets, buffers, length, codec, keys):
            t = t[:length]
            dev = t.device.type == self.device_type
            out.append((t, t if dev else t.numpy(), dev))
        return out

    def _host_bytes(self, t: torch.Tensor, kv, dev: bool) -> memoryview:
        """The payload as host bytes: a host buffer's own memory; a device buffer copied (counted)."""
        if not dev:
            return memoryview(kv)
        with self._lock:
            self.host_payload_bytes += t.numel()
        return memoryview(t.cpu().numpy())

    def write(self, f, offsets, buffers, length, checksums=None, finish=None, codec=None, keys=None) -> IOHandle:
        bufs = self._views(offsets, buffers, length, codec, keys)
        hdr_n = HEADER if codec is not None else 0

        def run(i: int) -> IOResult:
            try:
                t, kv, dev = bufs[i]
                c = None
                if codec is not None:
                    hdr = memoryview(bytearray(HEADER))
                    if codec.version == DEVICE_VERSION:   # hashed where the payload lies
                        c = codec.seal_hashed(hdr, keys[i], length, codec.payload_sum(t))
                    else:
                        c = codec.seal(hdr, keys[i], self._host_bytes(t, kv, dev))
                    if os.pwrite(f.fd, hdr, offsets[i]) != HEADER:
                        raise OSError(_errno.EIO, "short header write")
                elif checksums is not None:
                    c = _xxh3(self._host_bytes(t, kv, dev))
                if checksums is not None:
                    checksums[i] = c
                n = f.handle.pwrite(kv, length, offsets[i] + hdr_n).get()
                if n != length:
                    raise OSError(_errno.EIO, f"short write {n} of {length}")
                return IOResult(ok=[True], nbytes=length)
            except Exception as e:  # noqa: BLE001 - kvikio raises RuntimeError for I/O errors
                return self._error("write", e, f, offsets[i])

        return FutureHandle([self._pool.submit(run, i) for i in range(len(bufs))], finish)

    def _host_fallback(self, f: EngineFile, offset: int, t: torch.Tensor, codec, ver: int, ph: int) -> str | None:
        """A format-2 block for device memory: read and verified on the host, then copied to the
        device (only verified bytes reach it); why not, when it fails verification."""
        n = t.numel()
        buf = bytearray(n)
        got = os.preadv(f.fd, [buf], offset)
        if got != n:
            raise OSError(_errno.EIO, f"short read {got} of {n}")
        with self._lock:
            self.host_fallback_blocks += 1
            self.host_payload_bytes += n
            first = self.host_fallback_blocks == 1
        if first:
            log.warning("nvme io: %s holds format-%d (xxh3) blocks: read into device memory through the host "
                        "and verified there (counted in host_fallback_blocks; blocks written from now on are "
                        "format %d, verified on the device)", f.path, ver, DEVICE_VERSION)
        why = codec.check_payload(ver, ph, buf)
        if why is None:
            t.copy_(torch.frombuffer(buf, dtype=torch.uint8))
        return why

    def read(self, f, offsets, buffers, length, expect=None, mismatched=None, finish=None, codec=None,
             keys=None) -> IOHandle:
        bufs = self._views(offsets, buffers, length, codec, keys)
        hdr_n = HEADER if codec is not None else 0

        def bad(i: int, why: str) -> IOResult:
            if mismatched is not None:
                mismatched[i] = True
            return IOResult(ok=[False], nbytes=length, errors=[
                f"block at offset {offsets[i]} in {f.path} fails verification: {why}"])

        def run(i: int) -> IOResult:
            try:
                t, kv, dev = bufs[i]
                fault_point("read")
                if codec is not None and expect is not None:   # the header page first, on the host
                    got = codec.check_header(os.pread(f.fd, HEADER, offsets[i]), keys[i], expect[i], length)
                    if isinstance(got, str):
                        return bad(i, got)
                    ver, ph = got
                    if ver == SEALED_VERSION:
                        return bad(i, "an encrypted block (this engine does not decrypt)")
                    if dev and ver != DEVICE_VERSION:
                        why = self._host_fallback(f, offsets[i] + HEADER, t, codec, ver, ph)
                        return bad(i, why) if why else IOResult(ok=[True], nbytes=length)
                n = f.handle.pread(kv, length, offsets[i] + hdr_n).get()
                if n != length:
                    raise OSError(_errno.EIO, f"short read {n} of {length}")
                if expect is not None:
                    if codec is not None:   # format 4: hashed on the payload's device
                        why = codec.check_payload(ver, ph, t if ver == DEVICE_VERSION else memoryview(kv))
                    else:
                        got = _xxh3(self._host_bytes(t, kv, dev))
                        why = f"stored {expect[i]:016x}, read {got:016x}" if got != expect[i] else None
                    if why is not None:
                        return bad(i, why)
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
            host_bytes, fallback = self.host_payload_bytes, self.host_fallback_blocks
        return {"engine": self.description, "io_threads": self.threads, "compat_mode": self.compat,
                "mode": self.mode, "gds": self.mode == GDS, "io_errors": self.io_errors, "io_error_kinds": kinds,
                "host_payload_bytes": host_bytes, "host_fallback_blocks": fallback}
