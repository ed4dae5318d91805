"""NVMe tier, data plane: the preallocated data file of fixed 4 KiB-aligned slots and its I/O engine.

It reads and writes the slots a control plane chose (`nvme_control.NvmeControl`), seals each
block with a keyed header on write (in the I/O threads; the tag is the block's checksum) and
verifies key, tag and payload on read. It never opens the index, so it can live in a worker
process; it never creates the directory or its secret (the control plane does).
"""

from __future__ import annotations

import errno as _errno
import logging
import os
import shutil
from typing import Callable, Sequence

import torch

from .io_engine import IOHandle, IOResult
from .contract import Medium
from .io_engine import MAX_IO_BYTES
from .io_engines import select_engine
from .nvme_block import BlockCodec, load_secret, open_dir, slot_stride
from .nvme_dir import ForeignDirectory, data_file, dir_owner, oserror
from .sealing import Sealer

log = logging.getLogger("kvtier.nvme")


def check_space(name: str, path: str, capacity_blocks: int, block_bytes: int, rank: int = 0) -> None:
    """Raise ENOSPC naming both numbers when the slots would not fit the free space under `path`."""
    stride = slot_stride(block_bytes)
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
    several ranks each writes its own shard of every block into its own file, same slots).

    Every slot is a keyed header page then the payload (`nvme_block`); reads and writes take
    the blocks' keys. `read_only` opens the file as it is: nothing created, sized or written.
    The file is only ever grown, never truncated: a smaller capacity leaves the slots beyond it.
    `device_reads`: its engine reads into device memory itself (kvikio: GPUDirect Storage, or
    kvikio's compatibility mode), so loads without a promotion slot read into device staging
    rows and are verified there; its blocks are then format 4 (`nvme_block.DEVICE_VERSION`).
    """

    medium = Medium.FILE

    def __init__(self, directory: str, capacity_blocks: int, block_bytes: int, io: str = "auto",
                 io_threads: int = 4, direct: bool | str = "auto", max_io_bytes: int = MAX_IO_BYTES,
                 name: str = "nvme", rank: int = 0, read_only: bool = False, sealer: Sealer | None = None) -> None:
        self.dir = directory
        self.name = name
        self.rank = rank
        self.read_only = read_only
        self.capacity = capacity_blocks
        self.block_bytes = block_bytes
        self.stride = slot_stride(block_bytes)
        self.path = os.path.join(directory, data_file(rank))
        self.file = None
        self.engine = None
        self.device_reads = False
        self.dir_fd = -1
        self.bytes_read = self.bytes_written = 0
        try:
            self.dir_fd = open_dir(directory)
            if not read_only and dir_owner(self.dir_fd) != "kvtier":  # its control plane claims it first
                raise ForeignDirectory(_errno.EEXIST, f"nvme tier {name!r}: {directory} is not a kvtier "
                                       f"directory (no marker): refused, nothing in it changed", directory)
            secret, fp_hash = load_secret(self.dir_fd, directory, None, create=False)
            if not read_only:
                check_space(name, directory, capacity_blocks, block_bytes, rank)
            self.engine, self.engine_reason = select_engine(io, io_threads, direct, max_io_bytes)
            if sealer is not None and not self.engine.can_encrypt:
                raise OSError(_errno.EINVAL, f"nvme tier {name!r}: encryption needs io: posix "
                              f"({self.engine.description} moves blocks without a host copy)", directory)
            self.device_reads = self.engine.device_io
            self.codec = BlockCodec(secret, fp_hash, rank, sealer, device_sum=self.device_reads)
            if sealer is not None:  # its blocks always go through the engine's buffers: made now
                self.engine.reserve(self.stride, capacity_blocks)
            try:
                self.file = self.engine.open(self.path, dir_fd=self.dir_fd, read_only=read_only)
            except OSError as e:
                raise oserror(e, f"nvme tier {name!r}: cannot open data file", self.path) from None
            total = capacity_blocks * self.stride
            have = os.fstat(self.file.fd).st_size
            if have < total and not read_only:
                try:
                    os.posix_fallocate(self.file.fd, 0, total)
                except OSError as e:
                    raise oserror(e, f"nvme tier {name!r}: cannot size the data file to {total} B:",
                                  self.path) from None
        except BaseException:
            self.close()
            raise
        log.info("nvme tier %r (data plane): %s, %d slots x %d B (stride %d), engine %s (%s)%s%s", name, self.path,
                 capacity_blocks, block_bytes, self.stride, self.engine.description, self.engine_reason,
                 ", read-only" if read_only else "", ", AES-256-GCM" if sealer is not None else "")

    def _offsets(self, slots: Sequence[int]) -> list[int]:
        return [s * self.stride for s in slots]

    def write(self, slots: Sequence[int], srcs: Sequence[torch.Tensor], keys: Sequence[bytes] | None = None,
              finish: Callable[[IOResult], IOResult] | None = None) -> IOHandle:
        """Write blocks under their `keys`; the result's `tags[i]` is block i's tag (its checksum)."""
        if self.read_only:
            raise OSError(_errno.EROFS, f"nvme tier {self.name!r}: {self.path} is open read-only", self.path)
        if keys is None or len(keys) != len(slots):
            raise ValueError(f"nvme tier {self.name!r}: write of {len(slots)} blocks needs their keys")
        sums = [0] * len(slots)   # the engine fills them in its threads

        def done(r: IOResult) -> IOResult:
            self.bytes_written += r.nbytes
            r.tags = sums
            return finish(r) if finish else r
        return self.engine.write(self.file, self._offsets(slots), srcs, self.block_bytes, checksums=sums,
                                 finish=done, codec=self.codec, keys=keys)

    def read(self, slots: Sequence[int], dsts: Sequence[torch.Tensor], keys: Sequence[bytes] | None = None,
             expect: Sequence[int | Sequence[int]] | None = None,
             finish: Callable[[IOResult], IOResult] | None = None) -> IOHandle:
        """Read blocks and verify them against their `keys` and tags (`expect[i]`: the tag, or
        one per rank); a block that fails is ok=False and bad[i]=True in the result."""
        if keys is None or len(keys) != len(slots):
            raise ValueError(f"nvme tier {self.name!r}: read of {len(slots)} blocks needs their keys")
        if expect is None or len(expect) != len(slots):
            raise ValueError(f"nvme tier {self.name!r}: read of {len(slots)} blocks needs their expected tags")
        mismatched = [False] * len(slots)   # the engine marks the blocks that fail verification

        def done(r: IOResult) -> IOResult:
            self.bytes_read += r.nbytes
            r.bad = mismatched if any(mismatched) else []
            return finish(r) if finish else r
        r = self.rank  # several ranks: each verifies its own shard against its own tag
        mine = [e if isinstance(e, int) else (e[r] if r < len(e) else -1) for e in expect]
        return self.engine.read(self.file, self._offsets(slots), dsts, self.block_bytes, expect=mine,
                                mismatched=mismatched, finish=done, codec=self.codec, keys=keys)

    def sync(self) -> None:
        """fdatasync: written bytes are durable (OSError naming the path on failure)."""
        self.engine.sync(self.file)

    def drain(self) -> None:
        """Wait for every transfer in flight."""
        if self.engine is not None:
            self.engine.drain()

    @property
    def description(self) -> str:
        return self.engine.description

    @property
    def gds(self) -> bool | None:
        """Whether kvikio moves device memory by GPUDirect Storage (False: its compatibility mode;
        None: the engine moves no device memory)."""
        return None if self.engine is None or self.engine.mode is None else self.engine.mode == "GDS"

    def stats(self) -> dict:
        return {"engine": self.engine.description, "engine_reason": self.engine_reason,
                "bytes_read": self.bytes_read, "bytes_written": self.bytes_written, "io": self.engine.stats()}

    def close(self) -> None:
        if self.file is not None:
            self.engine.close_file(self.file)
            self.file = None
        if self.engine is not None:
            self.engine.close()
        if self.dir_fd >= 0:
            os.close(self.dir_fd)
            self.dir_fd = -1
