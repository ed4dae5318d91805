"""CPU DRAM data plane: one preallocated, pre-touched, page-aligned pool of block slots.

Host memory (`HostBuffer`, `host_buffer`) is an anonymous mapping, pre-touched, then registered
with CUDA (`cudaHostRegister`, in chunks) when pinning is asked and CUDA is present; if a chunk
fails, what was registered is unregistered and the buffer stays pageable, with one warning.
(`torch.empty(pin_memory=True)` would go through the caching host allocator, which rounds up to
a power of two, and make one huge `cudaHostAlloc` whose failure stops the worker.)
Copies go over cached per-slot views: memcpy split over the cores for host-to-host blocks,
batched `torch._foreach_copy_` otherwise.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import math
import mmap
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import torch

from .io_engine import DoneHandle, IOHandle, IOResult
from .contract import Medium

log = logging.getLogger("kvtier.cpu")

PAGE = mmap.PAGESIZE
PARALLEL_MIN_BYTES = 4 << 20  # below this one thread copies; above, the batch is split
REGISTER_CHUNK_BYTES = 1 << 30  # cudaHostRegister granularity (each chunk ends on a row and a page)
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14

_copy_pool: ThreadPoolExecutor | None = None
_memmove = ctypes.memmove  # a foreign call: releases the GIL while it copies


def copy_pool() -> ThreadPoolExecutor:
    global _copy_pool
    if _copy_pool is None:
        _copy_pool = ThreadPoolExecutor(max(1, (os.cpu_count() or 2) - 1), thread_name_prefix="kvtier-copy")
    return _copy_pool


def _move(triples: Sequence[tuple[int, int, int]]) -> None:
    for d, s, n in triples:
        _memmove(d, s, n)


def copy_blocks(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], block_bytes: int) -> None:
    """`dsts[i].copy_(srcs[i])` for all i.

    Host-to-host copies of contiguous blocks are plain memcpy calls split over the cores in
    Python threads (no torch intra-op threads: they oversubscribe 2-core machines when mixed
    with other threads). Anything else (a GPU side, strided views) goes to torch._foreach_copy_.
    """
    n = len(dsts)
    if n != len(srcs):
        raise ValueError(f"{n} destinations for {len(srcs)} sources")
    triples = []
    for d, s in zip(dsts, srcs):
        if d.device.type != "cpu" or s.device.type != "cpu" or not d.is_contiguous() or not s.is_contiguous():
            torch._foreach_copy_(list(dsts), list(srcs))
            return
        nb = d.numel() * d.element_size()
        if nb != s.numel() * s.element_size():
            raise ValueError(f"block copy: {s.numel() * s.element_size()} bytes into {nb}")
        triples.append((d.data_ptr(), s.data_ptr(), nb))
    workers = min(os.cpu_count() or 1, n, max(1, n * block_bytes // PARALLEL_MIN_BYTES))
    if workers <= 1:
        _move(triples)
        return
    step = (n + workers - 1) // workers
    futs = [copy_pool().submit(_move, triples[i:i + step]) for i in range(step, n, step)]
    _move(triples[:step])
    for f in futs:
        f.result()


def cuda_available() -> bool:
    try:
        return torch.cuda.is_available()
    except Exception:  # pragma: no cover - broken driver
        return False



# ---- host memory: anonymous mappings, pinned by chunks ----------------------------------------
_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context


def _loaded_library(prefix: str) -> str | None:
    """Path of the shared library named `prefix`* mapped into this process (from /proc/self/maps)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(None, 5)[-1]
                if os.path.basename(path).startswith(prefix):
                    return path
    except OSError:
        pass
    return None


class CudaHostRegistry:
    """The CUDA runtime calls that page-lock existing host memory, through PyTorch's bindings
    (`torch.cuda.cudart().cudaHostRegister(ptr, size, flags)` / `cudaHostUnregister(ptr)`, which
    return a `cudaError` instead of raising). Tests substitute a fake for `CUDA`."""

    def __init__(self) -> None:
        self._get_last_error = None  # ctypes cudaGetLastError of the runtime PyTorch loaded (or False)

    def register(self, ptr: int, size: int) -> str | None:
        """Page-lock [ptr, ptr + size); None, or why it failed."""
        rt = torch.cuda.cudart()
        return self._check(rt, rt.cudaHostRegister(ptr, size, _HOST_REGISTER_PORTABLE), "cudaHostRegister")

    def unregister(self, ptr: int) -> str | None:
        rt = torch.cuda.cudart()
        return self._check(rt, rt.cudaHostUnregister(ptr), "cudaHostUnregister")

    def _check(self, rt, err, call: str) -> str | None:
        code = int(err)
        if code == 0:
            return None
        self._clear_error()
        return f"{call}: CUDA error {code} ({rt.cudaGetErrorString(err)})"

    def _clear_error(self) -> None:
        """A failed runtime call leaves its error pending on this thread, and PyTorch's next
        kernel-launch check (cudaGetLastError) would raise it: take it off, as vLLM does.
        PyTorch's bindings have no cudaGetLastError, so it is called in the runtime it loaded."""
        if self._get_last_error is None:
            fn = False
            path = _loaded_library("libcudart")
            if path:
                try:
                    fn = ctypes.CDLL(path).cudaGetLastError
                    fn.restype, fn.argtypes = ctypes.c_int, []
                except (OSError, AttributeError):
                    fn = False
            if not fn:
                log.warning("host memory: no CUDA runtime library found in this process to clear a failed "
                            "registration's error; a later CUDA call may report it")
            self._get_last_error = fn
        if self._get_last_error:
            self._get_last_error()


CUDA = CudaHostRegistry()

_stats_lock = threading.Lock()
_stats = {"pinned_bytes": 0, "pin_fallbacks": 0, "unregister_errors": 0}
_warned: set[str] = set()  # the buffers (by `what`) whose pinning fallback was logged
_bounds: list[int] = []    # sorted start and end addresses of every registration now (with repeats)


def registration_ends(start: int, nbytes: int) -> list[int]:
    """Addresses strictly inside [start, start + nbytes) where a host registration begins or ends:
    a copy over the range is cut there so no copy spans two registrations."""
    with _stats_lock:
        lo = bisect.bisect_right(_bounds, start)
        hi = bisect.bisect_left(_bounds, start + nbytes)
        return sorted(set(_bounds[lo:hi]))


def _track(ptr: int, size: int, add: bool) -> None:
    with _stats_lock:
        for a in (ptr, ptr + size):
            if add:
                bisect.insort(_bounds, a)
            else:
                i = bisect.bisect_left(_bounds, a)
                if i < len(_bounds) and _bounds[i] == a:
                    del _bounds[i]


def host_memory_stats() -> dict:
    """This process's pinned host memory now, and how often pinning fell back to pageable."""
    with _stats_lock:
        return dict(_stats)


def _count(**kw: int) -> None:
    with _stats_lock:
        for k, v in kw.items():
            _stats[k] += v


def register_plan(nbytes: int, row_bytes: int = 1, chunk: int | None = None) -> list[tuple[int, int]]:
    """(offset, size) of each registration of a mapping of `nbytes` (a page multiple): chunks of
    about `chunk` (default REGISTER_CHUNK_BYTES) bytes, each starting on a page and a row boundary
    (no row straddles two registrations; the driver's page rounding never makes two overlap)."""
    unit = math.lcm(max(1, row_bytes), PAGE)
    step = max(unit, (chunk or REGISTER_CHUNK_BYTES) // unit * unit)
    return [(o, min(step, nbytes - o)) for o in range(0, nbytes, step)]


def _populate(mm: mmap.mmap, size: int) -> None:
    """Fault every page in now (not on the first copy)."""
    try:
        mm.madvise(_MADV_POPULATE_WRITE, 0, size)
    except (OSError, ValueError):  # kernel < 5.14: write one byte per page
        torch.frombuffer(mm, dtype=torch.uint8, count=size)[::PAGE].zero_()


def _unregister(reg, chunks: list[tuple[int, int]], mm: mmap.mmap | None, what: str) -> None:
    """Unregister `chunks` (newest first) and forget them; `mm` keeps the mapping alive until then."""
    n = 0
    for ptr, size in reversed(chunks):
        try:
            why = reg.unregister(ptr)
        except Exception as e:  # noqa: BLE001 - a broken CUDA runtime at shutdown
            why = f"cudaHostUnregister raised {e!r}"
        _track(ptr, size, add=False)
        if why is not None:
            _count(unregister_errors=1)
            log.warning("%s: %s at %#x (%d B)", what, why, ptr, size)
        n += size
    if chunks:
        _count(pinned_bytes=-n)
    chunks.clear()


class HostBuffer:
    """`nbytes` of page-aligned, pre-touched anonymous host memory as `tensor` (uint8).

    With `pin`, the mapping is registered with CUDA in chunks (`register_plan`, rows of
    `row_bytes` never straddling two); if any chunk fails, the registered ones are unregistered
    and the buffer stays pageable (a warning the first time for each `what`, and a count in
    `host_memory_stats`). `pinned` says which it is. `close()` (or the buffer's collection)
    unregisters; the mapping goes when the last tensor view of it does.
    """

    def __init__(self, nbytes: int, pin: bool = False, row_bytes: int = 1, what: str = "host buffer") -> None:
        if nbytes < 0:
            raise ValueError(f"{what}: size must be >= 0, got {nbytes}")
        self.nbytes = nbytes
        self.what = what
        self.size = max(-(-nbytes // PAGE) * PAGE, PAGE)
        mm = mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        _populate(mm, self.size)
        self.tensor = (torch.frombuffer(mm, dtype=torch.uint8, count=nbytes) if nbytes
                       else torch.empty(0, dtype=torch.uint8))
        self.pinned = False
        self.chunks: list[tuple[int, int]] = []  # (address, size) registered
        self._reg = CUDA
        self._release = weakref.finalize(self, _unregister, self._reg, self.chunks, mm, what)
        self._release.atexit = False  # at exit the driver drops the registrations itself
        if pin and nbytes:
            self.pinned = self._pin(self.tensor.data_ptr(), row_bytes)

    def _pin(self, base: int, row_bytes: int) -> bool:
        for off, n in register_plan(self.size, row_bytes):
            try:
                why = self._reg.register(base + off, n)
            except Exception as e:  # noqa: BLE001 - e.g. a runtime without the binding
                why = f"cudaHostRegister raised {e!r}"
            if why is not None:
                _unregister(self._reg, self.chunks, None, self.what)
                _count(pin_fallbacks=1)
                with _stats_lock:
                    first = self.what not in _warned
                    _warned.add(self.what)
                (log.warning if first else log.debug)(
                    "%s: cannot pin %d B (chunk at offset %d, %d B: %s); using pageable memory "
                    "(slower GPU<->CPU copies)", self.what, self.size, off, n, why)
                return False
            self.chunks.append((base + off, n))
            _track(base + off, n, add=True)
            _count(pinned_bytes=n)
        return True

    def close(self) -> None:
        """Unregister (if pinned) and let go of the mapping (freed with its last tensor view)."""
        self.pinned = False
        self._release()
        self.tensor = None  # type: ignore[assignment]


def host_buffer(nbytes: int, pin: str | bool = "auto", row_bytes: int = 1, what: str = "host buffer") -> HostBuffer:
    """A `HostBuffer` of `nbytes`: pinned when `pin` is True or 'auto' and CUDA is available
    (else pageable; True without CUDA warns); `row_bytes`: the size of the rows its users copy."""
    want = cuda_available() if pin == "auto" else bool(pin)
    if want and not cuda_available():
        log.warning("%s: pinned memory asked but CUDA is not available; using pageable memory", what)
        want = False
    return HostBuffer(nbytes, want, row_bytes, what)


class CpuPool:
    """`num_slots` x `block_bytes` of host memory (a `HostBuffer`); `rows` is [slot, block bytes],
    `views[i]` is slot i as a uint8 tensor."""

    medium = Medium.HOST

    def __init__(self, num_slots: int, block_bytes: int, pin: str | bool = "auto") -> None:
        self.num_slots = num_slots
        self.block_bytes = block_bytes
        total = num_slots * block_bytes
        self.host = host_buffer(total, pin, row_bytes=block_bytes, what="cpu pool")
        self.pinned = self.host.pinned
        self.buffer = self.host.tensor
        self.rows = self.buffer.view(num_slots, block_bytes)   # [slot, block bytes]
        self.views: list[torch.Tensor] = list(self.rows.unbind(0))
        log.info("cpu pool: %d slots x %d B = %d MiB, %s", num_slots, block_bytes, total >> 20,
                 f"pinned ({len(self.host.chunks)} registrations)" if self.pinned else "pageable")

    def write(self, slots: Sequence[int], srcs: Sequence[torch.Tensor],
              keys: Sequence[bytes] | None = None) -> IOHandle:
        """Copy `srcs[i]` (block_bytes each, any dtype viewed as bytes) into slot `slots[i]`
        (DRAM blocks carry no header: `keys` unused)."""
        views = self.views
        dst = [views[s] for s in slots]
        copy_blocks(dst, [_as_bytes(t) for t in srcs], self.block_bytes)
        return DoneHandle(IOResult(ok=[True] * len(dst), nbytes=len(dst) * self.block_bytes))

    def read(self, slots: Sequence[int], dsts: Sequence[torch.Tensor], keys: Sequence[bytes] | None = None,
             expect: Sequence | None = None) -> IOHandle:
        """Copy slot `slots[i]` into `dsts[i]` (not verified: `keys`, `expect` unused)."""
        views = self.views
        copy_blocks([_as_bytes(t) for t in dsts], [views[s] for s in slots], self.block_bytes)
        return DoneHandle(IOResult(ok=[True] * len(slots), nbytes=len(slots) * self.block_bytes))

    def sync(self) -> None:
        """Nothing to make durable."""

    def drain(self) -> None:
        """Nothing in flight (copies are done when `read` / `write` return)."""

    def close(self) -> None:
        """Unregister the pool's memory; it is unmapped once no view of it is left (unmapping
        under a live view would leave it pointing at nothing)."""
        self.views = []
        self.rows = None  # type: ignore[assignment]
        self.buffer = None  # type: ignore[assignment]
        self.pinned = False
        self.host.close()


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.uint8:
        return t.reshape(-1) if t.dim() != 1 else t
    return t.reshape(-1).view(torch.uint8)
