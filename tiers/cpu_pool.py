"""CPU DRAM data plane: one preallocated, pre-touched, page-aligned pool of block slots.

Pinned (page-locked, CUDA-registered) when CUDA is present, plain anonymous memory otherwise.
Copies go over cached per-slot views: memcpy split over the cores for host-to-host blocks,
batched `torch._foreach_copy_` otherwise.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import torch

from .handles import DoneHandle, IOHandle, IOResult

log = logging.getLogger("kvtier.cpu")

PAGE = mmap.PAGESIZE
PARALLEL_MIN_BYTES = 4 << 20  # below this one thread copies; above, the batch is split

_copy_pool: ThreadPoolExecutor | None = None
_memmove = ctypes.memmove  # a foreign call: releases the GIL while it copies


def _copier() -> ThreadPoolExecutor:
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
    futs = [_copier().submit(_move, triples[i:i + step]) for i in range(step, n, step)]
    _move(triples[:step])
    for f in futs:
        f.result()


def cuda_available() -> bool:
    try:
        return torch.cuda.is_available()
    except Exception:  # pragma: no cover - broken driver
        return False


class CpuPool:
    """`num_slots` x `block_bytes` of host memory; `views[i]` is slot i as a uint8 tensor."""

    def __init__(self, num_slots: int, block_bytes: int, pin: str | bool = "auto") -> None:
        self.num_slots = num_slots
        self.block_bytes = block_bytes
        total = num_slots * block_bytes
        want_pin = cuda_available() if pin == "auto" else bool(pin)
        self.pinned = False
        self._mmap = None
        if want_pin and cuda_available():
            self.buffer = torch.empty(total, dtype=torch.uint8, pin_memory=True)
            self.pinned = True
        else:
            if want_pin:
                log.warning("cpu pool: pinned memory asked but CUDA is not available; using plain memory")
            self._mmap = mmap.mmap(-1, max(total, PAGE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self.buffer = torch.frombuffer(self._mmap, dtype=torch.uint8, count=total)
        self.buffer.zero_()  # pre-touch every page now, not on the first copy
        self.views: list[torch.Tensor] = list(self.buffer.view(num_slots, block_bytes).unbind(0))
        log.info("cpu pool: %d slots x %d B = %d MiB, %s", num_slots, block_bytes, total >> 20,
                 "pinned" if self.pinned else "pageable")

    def write(self, slots: Sequence[int], srcs: Sequence[torch.Tensor]) -> IOHandle:
        """Copy `srcs[i]` (block_bytes each, any dtype viewed as bytes) into slot `slots[i]`."""
        views = self.views
        dst = [views[s] for s in slots]
        copy_blocks(dst, [_as_bytes(t) for t in srcs], self.block_bytes)
        return DoneHandle(IOResult(ok=[True] * len(dst), nbytes=len(dst) * self.block_bytes))

    def read(self, slots: Sequence[int], dsts: Sequence[torch.Tensor]) -> IOHandle:
        views = self.views
        copy_blocks([_as_bytes(t) for t in dsts], [views[s] for s in slots], self.block_bytes)
        return DoneHandle(IOResult(ok=[True] * len(slots), nbytes=len(slots) * self.block_bytes))

    def close(self) -> None:
        self.views = []
        self.buffer = None  # type: ignore[assignment]
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:  # a view is still alive somewhere; the GC will unmap
                pass
            self._mmap = None


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.uint8:
        return t.reshape(-1) if t.dim() != 1 else t
    return t.reshape(-1).view(torch.uint8)
