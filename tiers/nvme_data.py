"""NVMe tier, data plane: the preallocated data file of fixed 4 KiB-aligned slots and its I/O engine.

It reads and writes the slots a control plane chose (`nvme_control.NvmeControl`), computes
xxh3_64 checksums on write (in the I/O threads) and verifies expected checksums on read. It
never opens the index, so it can live in a worker process.
"""

from __future__ import annotations

import errno as _errno
import logging
import os
import shutil
from typing import Callable, Sequence

import torch

from .handles import IOHandle, IOResult
from .io_engines import ALIGN, MAX_IO_BYTES, round_up, select_engine
from .nvme_control import data_file, oserror

log = logging.getLogger("kvtier.nvme")


def check_space(name: str, path: str, capacity_blocks: int, block_bytes: int, rank: int = 0) -> None:
    """Raise ENOSPC naming both numbers when the slots would not fit the free space under `path`."""
    stride = round_up(block_bytes, ALIGN)
    p = os.path.abspath(path)
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    if not os.path.isdir(p):
        return  # creating the directory reports the bad path
    total = capacity_blocks * stride
    data = os.path.join(path, data_file(rank))
    have = os.path.getsize(data) if os.path.isfile(data) else 0
    free = shutil.disk_usage(p).free
    if total - have > free:
        raise OSError(_errno.ENOSPC, f"nvme tier {name!r}: capacity {capacity_blocks} blocks x {stride} B slots "
                      f"= {total} B needs {total - have} B more on disk, only {free} B free at {p}", path)


class NvmeData:
    """The data file ``data.<rank>`` under `directory`, sized to `capacity_blocks` slots (with
    several ranks each writes its own shard of every block into its own file, same slots)."""

    def __init__(self, directory: str, capacity_blocks: int, block_bytes: int, io: str = "auto",
                 io_threads: int = 4, direct: bool | str = "auto", max_io_bytes: int = MAX_IO_BYTES,
                 name: str = "nvme", rank: int = 0) -> None:
        self.dir = directory
        self.name = name
        self.rank = rank
        self.capacity = capacity_blocks
        self.block_bytes = block_bytes
        self.stride = round_up(block_bytes, ALIGN)
        self.path = os.path.join(directory, data_file(rank))
        self.file = None
        self.bytes_read = self.bytes_written = 0
        check_space(name, directory, capacity_blocks, block_bytes, rank)
        self.engine, self.engine_reason = select_engine(io, io_threads, direct, max_io_bytes)
        try:
            try:
                self.file = self.engine.open(self.path)
            except OSError as e:
                raise oserror(e, f"nvme tier {name!r}: cannot open data file", self.path) from None
            total = capacity_blocks * self.stride
            have = os.fstat(self.file.fd).st_size
            try:
                if have < total:
                    os.posix_fallocate(self.file.fd, 0, total)
                elif have > total:  # capacity shrank: the control plane drops entries beyond it
                    os.ftruncate(self.file.fd, total)
            except OSError as e:
                raise oserror(e, f"nvme tier {name!r}: cannot size the data file to {total} B:", self.path) from None
        except BaseException:
            self.close()
            raise
        log.info("nvme tier %r (data plane): %s, %d slots x %d B (stride %d), engine %s (%s)", name, self.path,
                 capacity_blocks, block_bytes, self.stride, self.engine.description, self.engine_reason)

    def _offsets(self, slots: Sequence[int]) -> list[int]:
        return [s * self.stride for s in slots]

    def write(self, slots: Sequence[int], srcs: Sequence[torch.Tensor], sums: list[int],
              finish: Callable[[IOResult], IOResult] | None = None) -> IOHandle:
        """Write blocks; `sums[i]` receives block i's checksum when the handle completes."""
        def done(r: IOResult) -> IOResult:
            self.bytes_written += r.nbytes
            return finish(r) if finish else r
        return self.engine.write(self.file, self._offsets(slots), srcs, self.block_bytes, checksums=sums,
                                 finish=done)

    def read(self, slots: Sequence[int], dsts: Sequence[torch.Tensor], expect: Sequence[int | Sequence[int]],
             mismatched: list[bool], finish: Callable[[IOResult], IOResult] | None = None) -> IOHandle:
        """Read blocks and verify them (`expect[i]`: the checksum, or one per rank); a checksum
        mismatch is ok=False and mismatched[i]=True."""
        def done(r: IOResult) -> IOResult:
            self.bytes_read += r.nbytes
            return finish(r) if finish else r
        r = self.rank  # several ranks: each verifies its own shard against its own checksum
        mine = [e if isinstance(e, int) else (e[r] if r < len(e) else -1) for e in expect]
        return self.engine.read(self.file, self._offsets(slots), dsts, self.block_bytes, expect=mine,
                                mismatched=mismatched, finish=done)

    def sync(self) -> None:
        """fdatasync: written bytes are durable."""
        self.engine.sync(self.file)

    @property
    def description(self) -> str:
        return self.engine.description

    def stats(self) -> dict:
        return {"engine": self.engine.description, "engine_reason": self.engine_reason,
                "bytes_read": self.bytes_read, "bytes_written": self.bytes_written, "io": self.engine.stats()}

    def close(self) -> None:
        if self.file is not None:
            self.engine.close_file(self.file)
            self.file = None
        self.engine.close()
