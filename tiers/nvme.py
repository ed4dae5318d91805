"""NVMe tier for one process: the control plane (`nvme_control`) with its data plane (`nvme_data`).

Layout under `path` (or `path/ns-<fingerprint hash>` in namespace mode): ``data.0`` (capacity
x (4 KiB header + block) slots, posix_fallocate'd, never truncated), ``index/`` (LMDB),
``secret`` (0600); the directory itself is flock'ed by the one writer.

Write order: `write()` seals each block with its keyed header (`nvme_block`) and puts it in
its slot, the tag computed in the I/O threads; `commit()` waits for those writes, fdatasyncs
the data file, then commits the index entries in one LMDB transaction. So the index never
points at unwritten bytes, and whatever was committed before a crash or restart is served
after it; uncommitted (pending) slots are simply free after a restart.

Reads verify each block's header (key, tag) and payload. A mismatch gives ok=False for that
block, increments `corrupt_blocks`, and quarantines the entry (lookup misses from then on;
the slot is freed once its last pin is released). A write or fdatasync error is ok=False /
an OSError: nothing is indexed.

A different fingerprint at `path` raises `FingerprintMismatch` (on_mismatch="refuse") or opens
`path/ns-<hash>` instead (on_mismatch="namespace"); foreign blocks are never served.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from kvtier.policies.base import NO_INFO, EvictionPolicy, RequestInfo

from .base import PENDING_SLOT, RESIDENT
from .io_engine import IOHandle, IOResult
from .io_engine import MAX_IO_BYTES
from .nvme_control import NvmeControl
from .nvme_data import NvmeData, check_space
from .sealing import FAILED, Sealer

log = logging.getLogger("kvtier.nvme")


class NvmeTier(NvmeControl):
    """Slot tier on NVMe. See the module docstring for layout, write order and recovery.

    `with_data=False` is a metadata-only tier (no files, no index): trace replay.
    `read_only=True` opens an existing directory (a live server's too) without its lock, and
    creates, sizes and writes nothing; reads are verified as usual.
    """

    _defer_publish = True

    def __init__(self, name: str, path: str, capacity_blocks: int, block_bytes: int, eviction: EvictionPolicy,
                 io: str = "auto", fingerprint: dict | None = None, on_mismatch: str = "refuse",
                 with_data: bool = True, io_threads: int = 4, direct: bool | str = "auto",
                 max_io_bytes: int = MAX_IO_BYTES, read_only: bool = False, allow_shrink: bool = False,
                 sealer: Sealer | None = None) -> None:
        if with_data and not read_only and capacity_blocks > 0 and block_bytes > 0:  # before the per-slot arrays
            check_space(name, path, capacity_blocks, block_bytes)
        self.with_data = with_data
        self.data: NvmeData | None = None
        self.io_errors = 0
        self.decrypt_failed_blocks = 0             # of the blocks failing verification: not opening (`sealing`)
        self._written: dict[int, bool] = {}        # pending slot -> its last write succeeded
        self._inflight: dict[int, IOHandle] = {}   # pending slot -> write handle not yet waited
        self._durable: set[int] = set()            # slots an executor wrote and flushed, being committed
        super().__init__(name, path, capacity_blocks, block_bytes, eviction, fingerprint, on_mismatch,
                         open_index=with_data, read_only=read_only, allow_shrink=allow_shrink)
        if not with_data:
            return
        try:
            self._recover()  # a refused shrink leaves the data file untouched
            self.data = NvmeData(self.dir, capacity_blocks, block_bytes, io, io_threads, direct, max_io_bytes,
                                 name=name, read_only=read_only, sealer=sealer)
            self._record_meta()
        except BaseException:
            self.close()
            raise
        log.info("nvme tier %r: %s, %d blocks restored%s", name, self.dir, self.restored_blocks,
                 f", {self.dropped_on_open} dropped" if self.dropped_on_open else "")

    @property
    def data_plane(self) -> NvmeData | None:
        return self.data

    def commit_written(self, slots: Sequence[int], sums: Sequence[int | tuple[int, ...]],
                       info: RequestInfo = NO_INFO) -> None:
        """Slots written and flushed through the data plane by an executor (not `write`): durable
        already, so committed without another fdatasync."""
        self._durable.update(slots)
        try:
            super().commit_written(slots, sums, info)
        finally:
            self._durable.difference_update(slots)

    # ---- control plane: the bytes are durable before the index says so -----------------
    def _before_index_put(self, slots: Sequence[int]) -> None:
        if self._durable.issuperset(slots):
            return
        for s in slots:
            h = self._inflight.pop(s, None)
            if h is not None:
                h.wait()
        for s in slots:
            if not self._written.get(s):
                raise ValueError(f"tier {self.name!r}: commit of slot {s} whose data was never written "
                                 f"or whose write failed; abort() it")
        if any(self._key_of[s] not in self._slot_of for s in slots):
            self.data.sync()
        for s in slots:
            self._written.pop(s, None)

    def abort(self, slots: Sequence[int]) -> None:
        for s in slots:
            h = self._inflight.pop(s, None)
            if h is not None:
                h.wait()  # the slot may be reused: its old write must be finished
            self._written.pop(s, None)
        super().abort(slots)

    # ---- data plane --------------------------------------------------------------------
    def _need_data(self) -> None:
        if not self.with_data:
            raise RuntimeError(f"tier {self.name!r} is metadata-only (with_data=False): no block I/O")
        if self.data is None:
            raise RuntimeError(f"tier {self.name!r} is closed")

    def _check_bufs(self, slots, bufs, what: str) -> None:
        if len(slots) != len(bufs):
            raise ValueError(f"tier {self.name!r}: {what} of {len(slots)} slots with {len(bufs)} buffers")
        for i, t in enumerate(bufs):
            n = t.numel() * t.element_size()
            if n != self.block_bytes:
                raise ValueError(f"tier {self.name!r}: {what} buffer {i} holds {n} bytes, "
                                 f"block_bytes is {self.block_bytes}")

    def write(self, slots: Sequence[int], srcs: Sequence[torch.Tensor]) -> IOHandle:
        """Write blocks into pending (allocated, uncommitted) slots; checksums taken in the I/O threads."""
        self._need_data()
        self._check_bufs(slots, srcs, "write")
        for s in slots:
            if self._state[s] != PENDING_SLOT or s in self._doomed:
                raise ValueError(f"tier {self.name!r}: write to slot {s} that is not pending (allocate it first)")
            h = self._inflight.pop(s, None)
            if h is not None:
                h.wait()
        slots = list(slots)

        def finish(r: IOResult) -> IOResult:
            for s, ok, c in zip(slots, r.ok, r.tags):
                self._written[s] = ok
                if ok:
                    self._sum[s] = c
                if self._inflight.get(s) is handle:
                    del self._inflight[s]
            if r.errors:
                self.io_errors += sum(1 for ok in r.ok if not ok)
            return r

        for s in slots:
            self._written[s] = False
        handle = self.data.write(slots, srcs, [self._key_of[s] for s in slots], finish=finish)
        for s in slots:
            self._inflight[s] = handle
        return handle

    def read(self, slots: Sequence[int], dsts: Sequence[torch.Tensor]) -> IOHandle:
        """Read and verify blocks; a block that fails its checksum is ok=False, counted and dropped."""
        self._need_data()
        self._check_bufs(slots, dsts, "read")
        slots = list(slots)
        for s in slots:
            st = self._state[s]
            if s in self._doomed or not (st == RESIDENT or (st == PENDING_SLOT and self._written.get(s))):
                if st == PENDING_SLOT and s in self._inflight:
                    self._inflight.pop(s).wait()
                    if self._written.get(s):
                        continue
                raise ValueError(f"tier {self.name!r}: read of slot {s} that holds no block")
        keys = [self._key_of[s] for s in slots]

        def finish(r: IOResult) -> IOResult:
            bad = r.bad or [False] * len(slots)
            corrupt = [s for s, k, b in zip(slots, keys, bad) if b and self._key_of[s] == k]
            sealed = sum(FAILED in e for e in r.errors)
            if corrupt and not (sealed and self.decrypt_failed_blocks):  # a wrong key: logged once
                log.error("nvme tier %r: %d blocks failed verification in %s; %s: %s", self.name, len(corrupt),
                          self.data.path if self.data else self.path,
                          "not served (read-only: index unchanged)" if self.read_only else "quarantined",
                          r.errors[:3])
            if corrupt:
                n = self.quarantine([s for s in corrupt if self._state[s] == RESIDENT],
                                    r.errors[0] if r.errors else "failed verification")
                self.corrupt_blocks += len(corrupt) - n
                self.decrypt_failed_blocks += sealed
            self.io_errors += sum(1 for ok, b in zip(r.ok, bad) if not ok and not b)
            return r

        return self.data.read(slots, dsts, keys, self.checksums(slots), finish=finish)

    def drain(self) -> None:
        """Wait for every transfer in flight, so their buffers may be freed (an interrupted caller)."""
        if self.data is not None:
            self.data.engine.drain()

    # ---- misc --------------------------------------------------------------------------
    @property
    def engine(self):
        return self.data.engine if self.data is not None else None

    @property
    def engine_reason(self) -> str:
        return self.data.engine_reason if self.data is not None else "metadata only (with_data=False)"

    @property
    def io_engine(self) -> str:
        return self.data.description if self.data is not None else "none (metadata only)"

    def summary(self) -> str:
        return f"{super().summary()}, io {self.io_engine}"

    @property
    def bytes_read(self) -> int:
        return self.data.bytes_read if self.data is not None else 0

    @property
    def bytes_written(self) -> int:
        return self.data.bytes_written if self.data is not None else 0

    def stats(self) -> dict:
        d = super().stats()
        d.update({"engine": self.io_engine, "engine_reason": self.engine_reason, "io_errors": self.io_errors,
                  "decrypt_failed_blocks": self.decrypt_failed_blocks,
                  "bytes_read": self.bytes_read, "bytes_written": self.bytes_written})
        if self.data is not None:
            d["io"] = self.data.engine.stats()
        return d

    def close(self) -> None:
        """Finish in-flight writes, close the file, engine and index, release the directory lock."""
        for h in list(self._inflight.values()):
            try:
                h.wait()
            except Exception:  # pragma: no cover - reported by the handle's owner
                pass
        self._inflight.clear()
        if self.data is not None:
            self.data.close()
            self.data = None
        super().close()
