"""NVMe tier: preallocated data file of fixed 4 KiB-aligned slots + a durable LMDB index.

Layout under `path` (or `path/ns-<fingerprint hash>` in namespace mode, see below):
``data.0`` (capacity x stride bytes, posix_fallocate'd), ``index/`` (LMDB), ``lock`` (flock:
one process per tier directory).

Write order: `write()` puts bytes in slots and computes their xxh3_64 checksums in the I/O
threads; `commit()` waits for those writes, fdatasyncs the data file, then commits the index
entries in one LMDB transaction. So the index never points at unwritten bytes, and whatever
was committed before a crash or restart is served after it; uncommitted (pending) slots are
simply free after a restart.

Reads verify each block against its checksum. A mismatch gives ok=False for that block,
increments `corrupt_blocks`, and drops the block (index entry deleted, key gone from lookup;
the slot is freed once its last pin is released): a corrupt block is a miss from then on.

The index stores a fingerprint (format version, block bytes, plus the caller's dict: model,
dtype, layout, rank, ...). A different fingerprint at `path` raises `FingerprintMismatch`
(on_mismatch="refuse") or opens `path/ns-<hash>` instead (on_mismatch="namespace"); foreign
blocks are never served.
"""

from __future__ import annotations

import errno as _errno
import fcntl
import json
import logging
import os
import shutil
from typing import Sequence

import torch
import xxhash

from kvtier.policies.base import EvictionPolicy, RequestInfo, _NO_INFO

from .base import _PENDING, _RESIDENT, SlotTier
from .handles import IOHandle, IOResult
from .io_engines import ALIGN, MAX_IO_BYTES, IOEngine, round_up, select_engine
from .nvme_index import FORMAT_VERSION, NvmeIndex

log = logging.getLogger("kvtier.nvme")

DATA_FILE = "data.0"
INDEX_DIR = "index"
LOCK_FILE = "lock"


class FingerprintMismatch(RuntimeError):
    """The tier directory holds blocks written under another fingerprint."""

    def __init__(self, path: str, diffs: dict[str, tuple[object, object]]) -> None:
        self.path = path
        self.diffs = diffs
        parts = ", ".join(f"{k}: stored={a!r} ours={b!r}" for k, (a, b) in sorted(diffs.items()))
        super().__init__(f"nvme tier at {path} was written with another fingerprint ({parts}); "
                         f"use on_mismatch='namespace' or another path")


def fingerprint_hash(fp: dict) -> str:
    return xxhash.xxh3_64_hexdigest(json.dumps(fp, sort_keys=True).encode())


def _diff(stored: dict, ours: dict) -> dict[str, tuple[object, object]]:
    return {k: (stored.get(k), ours.get(k)) for k in set(stored) | set(ours) if stored.get(k) != ours.get(k)}


def _oserror(e: OSError, what: str, path: str) -> OSError:
    name = _errno.errorcode.get(e.errno, str(e.errno)) if e.errno else "?"
    return OSError(e.errno, f"{what} {path}: [{name}] {e.strerror}", path)


def _check_space(name: str, path: str, cap: int, stride: int) -> None:
    """Raise ENOSPC naming both numbers when cap x stride exceeds the free space under `path`."""
    p = os.path.abspath(path)
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    if not os.path.isdir(p):
        return  # _make_dir reports the bad path
    total = cap * stride
    have = os.path.getsize(os.path.join(path, DATA_FILE)) if os.path.isfile(os.path.join(path, DATA_FILE)) else 0
    free = shutil.disk_usage(p).free
    if total - have > free:
        raise OSError(_errno.ENOSPC, f"nvme tier {name!r}: capacity {cap} blocks x {stride} B slots = {total} B "
                      f"needs {total - have} B more on disk, only {free} B free at {p}", path)


class NvmeTier(SlotTier):
    """Slot tier on NVMe. See the module docstring for layout, write order and recovery."""

    kind = "nvme"

    def __init__(self, name: str, path: str, capacity_blocks: int, block_bytes: int, eviction: EvictionPolicy,
                 io: str = "auto", fingerprint: dict | None = None, on_mismatch: str = "refuse",
                 with_data: bool = True, io_threads: int = 4, direct: bool | str = "auto",
                 max_io_bytes: int = MAX_IO_BYTES) -> None:
        if block_bytes <= 0:
            raise ValueError(f"tier {name!r}: block_bytes must be > 0, got {block_bytes}")
        if on_mismatch not in ("refuse", "namespace"):
            raise ValueError(f"tier {name!r}: on_mismatch must be 'refuse' or 'namespace', got {on_mismatch!r}")
        if with_data and capacity_blocks > 0:  # before the per-slot arrays: a huge capacity fails here
            _check_space(name, path, capacity_blocks, round_up(block_bytes, ALIGN))
        super().__init__(name, capacity_blocks, block_bytes, eviction)
        fp = dict(fingerprint or {})
        for k, v in (("block_bytes", block_bytes), ("format_version", FORMAT_VERSION)):
            if k in fp and fp[k] != v:
                raise ValueError(f"tier {name!r}: fingerprint field {k}={fp[k]!r} contradicts the tier's {v!r}")
            fp[k] = v
        self.fingerprint = fp
        self.stride = round_up(block_bytes, ALIGN)
        self.with_data = with_data
        self.path = os.path.abspath(path) if path else ""
        self.namespace: str | None = None
        self.corrupt_blocks = 0
        self.io_errors = 0
        self.bytes_read = 0
        self.bytes_written = 0
        self.dropped_on_open = 0
        self.restored_blocks = 0
        self._sum = [0] * capacity_blocks          # checksum of each written/resident slot
        self._written: dict[int, bool] = {}        # pending slot -> its last write succeeded
        self._inflight: dict[int, IOHandle] = {}   # pending slot -> write handle not yet waited
        self._doomed: set[int] = set()             # dropped while pinned: freed at ref 0
        self.engine: IOEngine | None = None
        self.engine_reason = "metadata only (with_data=False)"
        self.index: NvmeIndex | None = None
        self._file = None
        self._lock_fd = -1
        if not with_data:
            return
        try:
            self._open(io, io_threads, direct, max_io_bytes, on_mismatch)
        except BaseException:
            self.close()
            raise

    # ---- open / recovery ---------------------------------------------------------------
    def _open(self, io: str, threads: int, direct, max_io_bytes: int, on_mismatch: str) -> None:
        d = self.path
        self._make_dir(d)
        self._lock(d)
        self.index = NvmeIndex(os.path.join(d, INDEX_DIR), self._cap)
        stored = self.index.fingerprint()
        if stored is not None and stored != self.fingerprint:
            diffs = _diff(stored, self.fingerprint)
            if on_mismatch == "refuse":
                raise FingerprintMismatch(d, diffs)
            self.index.close()
            self._unlock()
            self.namespace = "ns-" + fingerprint_hash(self.fingerprint)
            d = os.path.join(self.path, self.namespace)
            log.warning("nvme tier %r: fingerprint differs from %s (%s); using namespace %s", self.name,
                        self.path, ", ".join(sorted(diffs)), d)
            self._make_dir(d)
            self._lock(d)
            self.index = NvmeIndex(os.path.join(d, INDEX_DIR), self._cap)
            stored = self.index.fingerprint()
            if stored is not None and stored != self.fingerprint:
                raise FingerprintMismatch(d, _diff(stored, self.fingerprint))
        self.dir = d
        stride = self.index.get_meta("slot_stride")
        if stride is not None and int(stride) != self.stride:
            raise FingerprintMismatch(d, {"slot_stride": (int(stride), self.stride)})

        data_path = os.path.join(d, DATA_FILE)
        total = self._cap * self.stride
        have = os.path.getsize(data_path) if os.path.exists(data_path) else 0
        need = max(0, total - have)
        free = shutil.disk_usage(d).free
        if need > free:
            raise OSError(_errno.ENOSPC, f"nvme tier {self.name!r}: capacity {self._cap} blocks x {self.stride} B "
                          f"= {total} B needs {need} B more on disk, only {free} B free at {d}", d)
        self.engine, self.engine_reason = select_engine(io, threads, direct, max_io_bytes)
        try:
            self._file = self.engine.open(data_path)
        except OSError as e:
            raise _oserror(e, f"nvme tier {self.name!r}: cannot open data file", data_path) from None
        if need:
            try:
                os.posix_fallocate(self._file.fd, 0, total)
            except OSError as e:
                raise _oserror(e, f"nvme tier {self.name!r}: cannot preallocate {total} B for", data_path) from None
        if stored is None:
            self.index.set_meta({"format_version": str(FORMAT_VERSION), "fingerprint": self.fingerprint,
                                 "slot_stride": str(self.stride), "capacity": str(self._cap)})
        else:
            self.index.set_meta({"capacity": str(self._cap)})
        self._recover()
        if have > total:  # capacity shrank: entries beyond it were dropped in _recover
            os.ftruncate(self._file.fd, total)
        log.info("nvme tier %r: %s, %d slots x %d B (stride %d), engine %s, %d blocks restored%s",
                 self.name, d, self._cap, self.block_bytes, self.stride, self.engine.description,
                 self.restored_blocks, f", {self.dropped_on_open} dropped" if self.dropped_on_open else "")

    def _make_dir(self, d: str) -> None:
        try:
            os.makedirs(d, exist_ok=True)
        except OSError as e:
            raise _oserror(e, f"nvme tier {self.name!r}: cannot create directory", d) from None
        probe = os.path.join(d, ".kvtier-probe")
        try:
            os.close(os.open(probe, os.O_CREAT | os.O_WRONLY, 0o644))
            os.unlink(probe)
        except OSError as e:
            raise _oserror(e, f"nvme tier {self.name!r}: directory is not writable:", d) from None

    def _lock(self, d: str) -> None:
        p = os.path.join(d, LOCK_FILE)
        fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            raise OSError(e.errno, f"nvme tier {self.name!r}: {d} is already open in another process "
                          f"or tier (flock {p}: {e.strerror})", d) from None
        self._lock_fd = fd

    def _unlock(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # closing releases the flock
            self._lock_fd = -1

    def _recover(self) -> None:
        """Serve every committed entry again, oldest generation first; drop invalid ones."""
        good, bad = [], []
        by_slot: dict[int, tuple[int, bytes]] = {}
        for key, e in self.index.items():
            if e.slot >= self._cap or e.length != self.block_bytes:
                bad.append(key)
                continue
            prev = by_slot.get(e.slot)
            if prev is not None:  # two keys on one slot: only the newer can hold its bytes
                if prev[0] > e.generation:
                    bad.append(key)
                    continue
                bad.append(prev[1])
            by_slot[e.slot] = (e.generation, key)
            good.append((e.generation, e.slot, key, e.checksum))
        keep = {k for _, k in by_slot.values()}
        good = sorted(g for g in good if g[2] in keep)
        if bad:
            log.warning("nvme tier %r: dropping %d index entries that do not fit this tier "
                        "(slot beyond capacity %d, wrong length, or a slot claimed twice)",
                        self.name, len(bad), self._cap)
            self.index.delete(bad)
            self.dropped_on_open = len(bad)
        for _, s, _, c in good:
            self._sum[s] = c
        self._restore([(s, k) for _, s, k, _ in good])
        self.restored_blocks = len(good)

    # ---- control plane -----------------------------------------------------------------
    def allocate(self, keys: Sequence[bytes], info: RequestInfo = _NO_INFO) -> list[int]:
        if self.index is not None:
            mk = self.index.max_key_size
            for k in keys:
                if len(k) > mk:
                    raise ValueError(f"tier {self.name!r}: key of {len(k)} bytes exceeds the index's "
                                     f"limit of {mk} bytes")
        return super().allocate(keys, info)

    def commit(self, slots: Sequence[int], info: RequestInfo = _NO_INFO) -> None:
        for s in slots:
            if s in self._doomed:
                raise ValueError(f"tier {self.name!r}: commit of slot {s} that was dropped")
        super().commit(slots, info)

    def _on_commit(self, slots: Sequence[int]) -> None:
        """Writes finished -> fdatasync(data) -> one LMDB txn of the new entries."""
        if not self.with_data:
            return
        for s in slots:
            h = self._inflight.pop(s, None)
            if h is not None:
                h.wait()
        for s in slots:
            if not self._written.get(s):
                raise ValueError(f"tier {self.name!r}: commit of slot {s} whose data was never written "
                                 f"or whose write failed; abort() it")
        items, seen = [], set()
        for s in slots:
            k = self._key_of[s]
            if k in self._slot_of or k in seen:  # a twin: SlotTier.commit keeps the resident one
                continue
            seen.add(k)
            items.append((k, s, self.block_bytes, self._sum[s]))
        if items:
            self.engine.sync(self._file)
            self.index.put(items)
        for s in slots:
            self._written.pop(s, None)

    def _on_evict(self, slots: Sequence[int]) -> None:
        if self.index is not None:
            self.index.delete([self._key_of[s] for s in slots])

    def abort(self, slots: Sequence[int]) -> None:
        for s in slots:
            h = self._inflight.pop(s, None)
            if h is not None:
                h.wait()  # the slot may be reused: its old write must be finished
            self._written.pop(s, None)
        super().abort([s for s in slots if s not in self._doomed])

    def free_blocks(self, block_ids: Sequence[int]) -> None:
        super().free_blocks(block_ids)
        if self._doomed:
            for b in block_ids:
                if b in self._doomed and self._ref[b] == 0:
                    self._doomed.discard(b)
                    self._release(b)

    def drop(self, slots: Sequence[int]) -> list[bytes]:
        """Remove resident blocks now, pinned or not (e.g. corrupt): index entry deleted, lookup misses.

        Unpinned slots are freed at once; pinned ones when their last pin is released.
        Returns the dropped keys.
        """
        slots = [s for s in dict.fromkeys(slots) if self._state[s] == _RESIDENT and s not in self._doomed]
        keys = [self._key_of[s] for s in slots]
        if self.index is not None and keys:
            self.index.delete(keys)
        for s, k in zip(slots, keys):
            del self._slot_of[k]
            self.eviction.on_remove(s, k)
            if self._ref[s] == 0:
                self._release(s)
            else:
                self._state[s] = _PENDING  # invisible, not evictable, not readable
                self._doomed.add(s)
        return keys

    # ---- data plane --------------------------------------------------------------------
    def _need_data(self) -> None:
        if not self.with_data:
            raise RuntimeError(f"tier {self.name!r} is metadata-only (with_data=False): no block I/O")
        if self._file is None:
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
            if self._state[s] != _PENDING or s in self._doomed:
                raise ValueError(f"tier {self.name!r}: write to slot {s} that is not pending (allocate it first)")
            h = self._inflight.pop(s, None)
            if h is not None:
                h.wait()
        slots = list(slots)
        sums = [0] * len(slots)

        def finish(r: IOResult) -> IOResult:
            for s, ok, c in zip(slots, r.ok, sums):
                self._written[s] = ok
                if ok:
                    self._sum[s] = c
                if self._inflight.get(s) is handle:
                    del self._inflight[s]
            self.bytes_written += r.nbytes
            if r.errors:
                self.io_errors += sum(1 for ok in r.ok if not ok)
            return r

        for s in slots:
            self._written[s] = False
        handle = self.engine.write(self._file, [s * self.stride for s in slots], srcs, self.block_bytes,
                                   checksums=sums, finish=finish)
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
            if s in self._doomed or not (st == _RESIDENT or (st == _PENDING and self._written.get(s))):
                if st == _PENDING and s in self._inflight:
                    self._inflight.pop(s).wait()
                    if self._written.get(s):
                        continue
                raise ValueError(f"tier {self.name!r}: read of slot {s} that holds no block")
        keys = [self._key_of[s] for s in slots]
        bad = [False] * len(slots)

        def finish(r: IOResult) -> IOResult:
            self.bytes_read += r.nbytes
            corrupt = [s for s, k, b in zip(slots, keys, bad) if b and self._key_of[s] == k]
            if corrupt:
                self.corrupt_blocks += len(corrupt)
                log.error("nvme tier %r: %d corrupt blocks (checksum mismatch) in %s; dropped: %s",
                          self.name, len(corrupt), self._file.path if self._file else self.path,
                          r.errors[:3])
                self.drop([s for s in corrupt if self._state[s] == _RESIDENT])
            n_io = sum(1 for ok, b in zip(r.ok, bad) if not ok and not b)
            self.io_errors += n_io
            return r

        return self.engine.read(self._file, [s * self.stride for s in slots], dsts, self.block_bytes,
                                expect=[self._sum[s] for s in slots], mismatched=bad, finish=finish)

    # ---- misc --------------------------------------------------------------------------
    @property
    def io_engine(self) -> str:
        return self.engine.description if self.engine else "none (metadata only)"

    def stats(self) -> dict:
        d = super().stats()
        d.update({"engine": self.io_engine, "engine_reason": self.engine_reason,
                  "path": getattr(self, "dir", self.path), "namespace": self.namespace,
                  "slot_stride": self.stride, "corrupt_blocks": self.corrupt_blocks,
                  "io_errors": self.io_errors, "bytes_read": self.bytes_read,
                  "bytes_written": self.bytes_written, "restored_blocks": self.restored_blocks,
                  "dropped_on_open": self.dropped_on_open, "fingerprint": dict(self.fingerprint)})
        if self.engine is not None:
            d["io"] = self.engine.stats()
        return d

    def close(self) -> None:
        """Finish in-flight writes, close the file, engine and index, release the directory lock."""
        for h in list(self._inflight.values()):
            try:
                h.wait()
            except Exception:  # pragma: no cover - reported by the handle's owner
                pass
        self._inflight.clear()
        if self._file is not None and self.engine is not None:
            self.engine.close_file(self._file)
        self._file = None
        if self.engine is not None:
            self.engine.close()
        if self.index is not None:
            self.index.close()
            self.index = None
        self._unlock()

    def __enter__(self) -> "NvmeTier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
