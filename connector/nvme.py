"""The NVMe tier split in two for the connector: control plane (scheduler) and data plane (worker).

vLLM may run the scheduler and the workers in different processes, so the two halves share
nothing but a directory and the per-step metadata:

- `NvmeControl` (scheduler): the slot allocator, reference counts, eviction order and the
  durable LMDB index (key -> slot, length, checksum, generation) of `kvtier.tiers.nvme_index`.
  It never opens the data file. A block is committed to the index only after the worker
  reported that its bytes were written and fdatasync'd, with the checksum the worker computed.
  At open it restores every committed entry, so a new scheduler serves what an old one wrote.
- `NvmeData` (worker): the preallocated data file ``data.0`` (fixed 4 KiB-aligned slots) and an
  I/O engine (`kvtier.tiers.io_engines`: POSIX O_DIRECT preadv/pwritev, or kvikio with CUDA).
  It reads and writes the slots the scheduler chose, computes checksums on write and verifies
  the scheduler's expected checksums on read. It never opens LMDB.

The directory layout is the one `kvtier.tiers.nvme.NvmeTier` uses (``data.0``, ``index/``,
``lock``), so `kvtier inspect` and the offline tools read a connector's tier directory.
"""

from __future__ import annotations

import errno as _errno
import fcntl
import logging
import os
import shutil
from typing import Sequence

import torch

from kvtier.policies.base import EvictionPolicy, RequestInfo, _NO_INFO
from kvtier.tiers.base import _PENDING, _RESIDENT, SlotTier
from kvtier.tiers.handles import IOHandle
from kvtier.tiers.io_engines import ALIGN, round_up, select_engine
from kvtier.tiers.nvme import DATA_FILE, INDEX_DIR, LOCK_FILE, FingerprintMismatch, _diff, fingerprint_hash
from kvtier.tiers.nvme_index import FORMAT_VERSION, NvmeIndex

log = logging.getLogger("kvtier.connector")


class NvmeControl(SlotTier):
    """Scheduler-side NVMe tier: slots + LMDB index; no data file."""

    kind = "nvme"

    def __init__(self, name: str, path: str, capacity_blocks: int, block_bytes: int, eviction: EvictionPolicy,
                 fingerprint: dict | None = None, on_mismatch: str = "refuse") -> None:
        self._doomed: set[int] = set()  # dropped while pinned: freed at ref 0
        super().__init__(name, capacity_blocks, block_bytes, eviction)
        fp = dict(fingerprint or {})
        fp["block_bytes"] = block_bytes
        fp["format_version"] = FORMAT_VERSION
        self.fingerprint = fp
        self.stride = round_up(block_bytes, ALIGN)
        self.path = os.path.abspath(path)
        self.namespace: str | None = None
        self._sum = [0] * capacity_blocks
        self._lock_fd = -1
        self.index: NvmeIndex | None = None
        self.restored_blocks = 0
        self.dropped_on_open = 0
        self.corrupt_blocks = 0
        try:
            self._open(on_mismatch)
        except BaseException:
            self.close()
            raise

    def _open(self, on_mismatch: str) -> None:
        d = self.path
        os.makedirs(d, exist_ok=True)
        self._lock(d)
        self.index = NvmeIndex(os.path.join(d, INDEX_DIR), self._cap)
        stored = self.index.fingerprint()
        if stored is not None and stored != self.fingerprint:
            if on_mismatch != "namespace":
                raise FingerprintMismatch(d, _diff(stored, self.fingerprint))
            self.index.close()
            self._unlock()
            self.namespace = "ns-" + fingerprint_hash(self.fingerprint)
            d = os.path.join(self.path, self.namespace)
            log.warning("kvtier nvme %r: fingerprint differs from %s; using namespace %s", self.name, self.path, d)
            os.makedirs(d, exist_ok=True)
            self._lock(d)
            self.index = NvmeIndex(os.path.join(d, INDEX_DIR), self._cap)
            stored = self.index.fingerprint()
            if stored is not None and stored != self.fingerprint:
                raise FingerprintMismatch(d, _diff(stored, self.fingerprint))
        self.dir = d
        st = self.index.get_meta("slot_stride")
        if st is not None and int(st) != self.stride:
            raise FingerprintMismatch(d, {"slot_stride": (int(st), self.stride)})
        total = self._cap * self.stride
        dp = os.path.join(d, DATA_FILE)
        have = os.path.getsize(dp) if os.path.exists(dp) else 0
        if total - have > shutil.disk_usage(d).free:
            raise OSError(_errno.ENOSPC, f"kvtier nvme {self.name!r}: {self._cap} blocks x {self.stride} B "
                          f"needs {total - have} B more at {d}", d)
        if stored is None:
            self.index.set_meta({"format_version": str(FORMAT_VERSION), "fingerprint": self.fingerprint,
                                 "slot_stride": str(self.stride), "capacity": str(self._cap)})
        self._recover()
        log.info("kvtier nvme %r (control plane): %s, %d slots x %d B, %d blocks restored", self.name, d,
                 self._cap, self.block_bytes, self.restored_blocks)

    def _lock(self, d: str) -> None:
        p = os.path.join(d, LOCK_FILE)
        fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            raise OSError(e.errno, f"kvtier nvme {self.name!r}: {d} is already open by another scheduler "
                          f"(flock {p}: {e.strerror})", d) from None
        self._lock_fd = fd

    def _unlock(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def _recover(self) -> None:
        good, bad, by_slot = [], [], {}
        for key, e in self.index.items():
            if e.slot >= self._cap or e.length != self.block_bytes:
                bad.append(key)
                continue
            prev = by_slot.get(e.slot)
            if prev is not None:
                if prev[0] > e.generation:
                    bad.append(key)
                    continue
                bad.append(prev[1])
            by_slot[e.slot] = (e.generation, key)
            good.append((e.generation, e.slot, key, e.checksum))
        keep = {k for _, k in by_slot.values()}
        good = sorted(g for g in good if g[2] in keep)
        if bad:
            self.index.delete(bad)
            self.dropped_on_open = len(bad)
        for _, s, _, c in good:
            self._sum[s] = c
        self._restore([(s, k) for _, s, k, _ in good])
        self.restored_blocks = len(good)

    # ---- control plane -----------------------------------------------------------------
    def checksums(self, slots: Sequence[int]) -> list[int]:
        return [self._sum[s] for s in slots]

    def commit_written(self, slots: Sequence[int], sums: Sequence[int], info: RequestInfo = _NO_INFO) -> None:
        """The worker wrote (and fdatasync'd) these slots with these checksums: publish them."""
        for s, c in zip(slots, sums):
            self._sum[s] = c
        self.commit(slots, info)

    def _on_commit(self, slots: Sequence[int]) -> None:
        items, seen = [], set()
        for s in slots:
            k = self._key_of[s]
            if k in self._slot_of or k in seen:
                continue
            seen.add(k)
            items.append((k, s, self.block_bytes, self._sum[s]))
        if items:
            self.index.put(items)

    def _on_evict(self, slots: Sequence[int]) -> None:
        self.index.delete([self._key_of[s] for s in slots])

    def drop(self, slots: Sequence[int]) -> int:
        """Forget resident blocks that failed verification (index entry deleted: a miss from now on).

        A pinned slot (another request's lease) leaves the index and lookups now and is freed
        by `free_blocks` when its last pin goes.
        """
        slots = [s for s in dict.fromkeys(slots) if self._state[s] == _RESIDENT]
        keys = [self._key_of[s] for s in slots]
        if keys:
            self.index.delete(keys)
        for s, k in zip(slots, keys):
            del self._slot_of[k]
            self.eviction.on_remove(s, k)
            if self._ref[s] == 0:
                self._release(s)
            else:
                self._state[s] = _PENDING
                self._pending.discard(s)
                self._doomed.add(s)
        self.corrupt_blocks += len(slots)
        return len(slots)

    def free_blocks(self, block_ids: Sequence[int]) -> None:
        super().free_blocks(block_ids)
        doomed = self._doomed
        if doomed:
            for b in block_ids:
                if b in doomed and self._ref[b] == 0:
                    doomed.discard(b)
                    self._release(b)

    def stats(self) -> dict:
        d = super().stats()
        d.update({"path": getattr(self, "dir", self.path), "restored_blocks": self.restored_blocks,
                  "dropped_on_open": self.dropped_on_open, "corrupt_blocks": self.corrupt_blocks})
        return d

    def close(self) -> None:
        if self.index is not None:
            self.index.close()
            self.index = None
        self._unlock()


class NvmeData:
    """Worker-side NVMe tier: the data file and its I/O engine; no index."""

    def __init__(self, directory: str, capacity_blocks: int, block_bytes: int, io: str = "auto",
                 io_threads: int = 4, direct: bool | str = "auto") -> None:
        self.dir = directory
        self.capacity = capacity_blocks
        self.block_bytes = block_bytes
        self.stride = round_up(block_bytes, ALIGN)
        self.engine, self.engine_reason = select_engine(io, io_threads, direct)
        os.makedirs(directory, exist_ok=True)
        p = os.path.join(directory, DATA_FILE)
        self.file = self.engine.open(p)
        total = capacity_blocks * self.stride
        if os.fstat(self.file.fd).st_size < total:
            os.posix_fallocate(self.file.fd, 0, total)
        self.path = p
        log.info("kvtier nvme (data plane): %s, %d slots x %d B, engine %s (%s)", p, capacity_blocks,
                 block_bytes, self.engine.description, self.engine_reason)

    def write(self, slots: Sequence[int], srcs: Sequence[torch.Tensor], sums: list[int]) -> IOHandle:
        return self.engine.write(self.file, [s * self.stride for s in slots], srcs, self.block_bytes, checksums=sums)

    def read(self, slots: Sequence[int], dsts: Sequence[torch.Tensor], expect: Sequence[int],
             mismatched: list[bool]) -> IOHandle:
        return self.engine.read(self.file, [s * self.stride for s in slots], dsts, self.block_bytes,
                                expect=list(expect), mismatched=mismatched)

    def sync(self) -> None:
        self.engine.sync(self.file)

    @property
    def description(self) -> str:
        return self.engine.description

    def close(self) -> None:
        if self.file is not None:
            self.engine.close_file(self.file)
            self.file = None
        self.engine.close()
