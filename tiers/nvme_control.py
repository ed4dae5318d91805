"""NVMe tier, control plane: slots, reference counts, eviction order and the durable LMDB index.

It never touches the data file (that is `nvme_data.NvmeData`), so a scheduler in one process
can own it while workers elsewhere move the bytes. Directory layout under `path` (or
`path/ns-<fingerprint hash>` in namespace mode): ``data.<rank>`` (the slots), ``index/``
(LMDB), ``secret`` (0600, the key of the block tags, created here). The writer holds a flock
on the directory itself: one control plane per directory, and deleting a file cannot defeat it.

A block becomes visible only through `commit`, which writes its index entry (key -> slot,
length, block tag, generation) after its bytes were written and flushed; at open every
committed entry is served again (`nvme_recovery`). The index stores a fingerprint (format
version, block bytes, plus the caller's model, dtype, layout, rank, ...): another fingerprint at `path` raises
`FingerprintMismatch` (on_mismatch="refuse") or opens `path/ns-<hash>` ("namespace"), so
foreign blocks are never served.
"""

from __future__ import annotations

import errno as _errno
import logging
import os
from typing import Sequence

from kvtier.common.once import Once
from kvtier.policies.base import EvictionPolicy, RequestInfo, NO_INFO

from .base import PENDING_SLOT, RESIDENT, SlotTier
from .contract import Medium
from kvtier.common.counters import Metric
from .io_engine import crash_point
from .nvme_block import SECRET_FILE, NoSecret, check_tree, load_secret, open_dir, record_fingerprint, slot_stride
from .nvme_dir import (DATA_FILE, INDEX_DIR, FingerprintMismatch, claim_dir, exists_at, fingerprint_diff,
                       fingerprint_hash, lock_dir, make_fingerprint)
from .nvme_index import NvmeIndex
from .nvme_recovery import layout_meta, recover_index, refuse_orphaned_blocks

log = logging.getLogger("kvtier.nvme")


class NvmeControl(SlotTier):
    """Slot tier whose residents are recorded in an LMDB index that survives restarts.

    `commit(slots)` publishes pending slots whose checksums (block tags) were set
    (`set_checksums`); a subclass that owns the data file flushes it first
    (`_before_index_put`). `quarantine` takes blocks that failed verification out of service.

    Opening never destroys: a capacity smaller than what is stored raises `CapacityShrink`
    (`allow_shrink=True` evicts the entries beyond it by the eviction policy and reports them in
    `dropped_on_open`). `read_only=True` opens a live or stopped directory without the writer
    lock and writes nothing (entries beyond the capacity are counted, not served). One writer
    per directory: a flock on the directory itself (deleting a file cannot defeat it); a held
    lock is `DirectoryInUse` naming the holder's pid.
    """

    kind = "nvme"
    medium = Medium.FILE
    verifies = True
    _defer_publish = False  # NvmeTier opens its data file before serving the index

    def __init__(self, name: str, path: str, capacity_blocks: int, block_bytes: int, eviction: EvictionPolicy,
                 fingerprint: dict | None = None, on_mismatch: str = "refuse", open_index: bool = True,
                 read_only: bool = False, allow_shrink: bool = False) -> None:
        if block_bytes <= 0:
            raise ValueError(f"tier {name!r}: block_bytes must be > 0, got {block_bytes}")
        if on_mismatch not in ("refuse", "namespace"):
            raise ValueError(f"tier {name!r}: on_mismatch must be 'refuse' or 'namespace', got {on_mismatch!r}")
        super().__init__(name, capacity_blocks, block_bytes, eviction)
        self.fingerprint = make_fingerprint(name, block_bytes, fingerprint)
        self.stride = slot_stride(block_bytes)
        self.path = os.path.abspath(path) if path else ""
        self.dir = self.path
        self.read_only = read_only
        self.allow_shrink = allow_shrink
        self.namespace: str | None = None
        self.corrupt_blocks = 0
        self.dropped_on_open = 0
        self.beyond_capacity = 0
        self.restored_blocks = 0
        self.stored_capacity: int | None = None
        self.index: NvmeIndex | None = None
        # checksum of each written/resident slot; a tuple (one per rank) when several ranks write shards
        self._sum: list[int | tuple[int, ...]] = [0] * capacity_blocks
        self._doomed: set[int] = set()          # dropped while pinned: freed at ref 0
        self._stale: set[bytes] = set()         # index deletes that failed (disk full, read-only): retried
        self.index_write_errors = 0
        self._once = Once(log)
        self._dir_fd = -1
        self._locked = False
        self._stored_meta: dict | None = None
        if open_index:
            try:
                self._open_index(on_mismatch)
                if not self._defer_publish:
                    self._publish_meta()
            except BaseException:
                self.close()
                raise

    # ---- open / recovery ---------------------------------------------------------------
    def _open_at(self, d: str) -> dict | None:
        """Open directory `d` (locked unless read-only) and its index; the stored fingerprint."""
        self._dir_fd = open_dir(d) if self.read_only else claim_dir(d)
        if not self.read_only:
            self._lock(d)
        idx = os.path.join(d, INDEX_DIR)
        check_tree(d, [INDEX_DIR, DATA_FILE])
        check_tree(idx, ["data.mdb", "lock.mdb"])
        if not self.read_only:
            try:
                os.mkdir(idx, 0o700)
            except FileExistsError:
                pass
        self.index = NvmeIndex(idx, self._cap, read_only=self.read_only)
        fp = self.index.fingerprint()
        if fp is None and not self.read_only:
            refuse_orphaned_blocks(self._dir_fd, d, self.stride)
        return fp

    def _close_dir(self) -> None:
        if self.index is not None:
            self.index.close()
            self.index = None
        self._unlock()

    def _open_index(self, on_mismatch: str) -> None:
        d = self.path
        stored = self._open_at(d)
        if stored is not None and stored != self.fingerprint:
            diffs = fingerprint_diff(stored, self.fingerprint)
            if on_mismatch == "refuse":
                raise FingerprintMismatch(d, diffs)
            self._close_dir()
            self.namespace = "ns-" + fingerprint_hash(self.fingerprint)
            d = os.path.join(self.path, self.namespace)
            log.warning("nvme tier %r: fingerprint differs from %s (%s); using namespace %s", self.name,
                        self.path, ", ".join(sorted(diffs)), d)
            stored = self._open_at(d)
            if stored is not None and stored != self.fingerprint:
                raise FingerprintMismatch(d, fingerprint_diff(stored, self.fingerprint))
        self.dir = d
        stride = self.index.get_meta("slot_stride")
        if stride is not None and int(stride) != self.stride:
            raise FingerprintMismatch(d, {"slot_stride": (int(stride), self.stride)})
        cap = self.index.get_meta("capacity")
        self.stored_capacity = int(cap) if cap is not None and cap.isdigit() else None
        fph = int(fingerprint_hash(self.fingerprint), 16)
        n = len(self.index)
        if n and not self.read_only and not exists_at(self._dir_fd, SECRET_FILE):
            # a new secret would leave every indexed block unverifiable behind a silent start
            raise NoSecret(_errno.ENOENT, f"secret file {os.path.join(d, SECRET_FILE)} is missing and the index "
                           f"lists {n} blocks that cannot be verified without it: `kvtier fsck --rebuild` starts "
                           f"the index empty (the old one is kept aside)", os.path.join(d, SECRET_FILE))
        try:
            load_secret(self._dir_fd, d, fph, create=not self.read_only)
        except NoSecret:
            if not self.read_only:
                raise
        if not self.read_only:
            record_fingerprint(self._dir_fd, d, self.fingerprint)
        self._stored_meta = stored

    def _publish_meta(self) -> None:
        """Serve the committed entries, then record the layout (first open) or the capacity."""
        self._recover()
        self._record_meta()

    def _record_meta(self) -> None:
        if self.read_only:
            return
        if self._stored_meta is None:
            self.index.set_meta(layout_meta(self.fingerprint, self.stride, self._cap))
        else:
            self.index.set_meta({"capacity": str(self._cap)})

    def _lock(self, d: str) -> None:
        lock_dir(self._dir_fd, d, f"nvme tier {self.name!r}")
        self._locked = True

    def _unlock(self) -> None:
        if self._dir_fd >= 0:
            os.close(self._dir_fd)  # closing releases the flock
            self._dir_fd = -1
        self._locked = False

    def _recover(self) -> None:
        """Serve every committed entry again (`nvme_recovery.recover_index`: nothing is deleted
        unless `allow_shrink`; bad entries are quarantined, none on a read-only open)."""
        r = recover_index(self.index, name=self.name, path=self.dir, block_bytes=self.block_bytes,
                          capacity=self._cap, stored_capacity=self.stored_capacity, read_only=self.read_only,
                          allow_shrink=self.allow_shrink)
        self.beyond_capacity = r.beyond
        self.dropped_on_open = r.dropped
        for s, _, c in r.serve:
            self._sum[s] = c
        self._restore([(s, k) for s, k, _ in r.serve])
        self.restored_blocks = len(r.serve)

    # ---- control plane -----------------------------------------------------------------
    def checksums(self, slots: Sequence[int]) -> list[int | tuple[int, ...]]:
        """The checksums a reader must verify these slots against (per rank: a tuple)."""
        return [self._sum[s] for s in slots]

    def set_checksums(self, slots: Sequence[int], sums: Sequence[int | tuple[int, ...]]) -> None:
        for s, c in zip(slots, sums):
            self._sum[s] = c

    def commit_written(self, slots: Sequence[int], sums: Sequence[int | tuple[int, ...]],
                       info: RequestInfo = NO_INFO) -> None:
        """These pending slots were written and flushed with these checksums (one per rank when
        several ranks wrote their shards): publish them."""
        self.set_checksums(slots, sums)
        self.commit(slots, info)

    def allocate(self, keys: Sequence[bytes], info: RequestInfo = NO_INFO) -> list[int]:
        if self.read_only:
            raise OSError(_errno.EROFS, f"tier {self.name!r}: {self.dir} is open read-only", self.dir)
        if self.index is not None:
            mk = self.index.max_key_size
            for k in keys:
                if len(k) > mk:
                    raise ValueError(f"tier {self.name!r}: key of {len(k)} bytes exceeds the index's "
                                     f"limit of {mk} bytes")
        return super().allocate(keys, info)

    def commit(self, slots: Sequence[int], info: RequestInfo = NO_INFO) -> None:
        for s in slots:
            if s in self._doomed:
                raise ValueError(f"tier {self.name!r}: commit of slot {s} that was dropped")
        super().commit(slots, info)

    def _before_index_put(self, slots: Sequence[int]) -> None:
        """Hook: make the slots' bytes durable before their index entries are written."""

    def _on_commit(self, slots: Sequence[int]) -> None:
        if self.index is None:
            return
        self._before_index_put(slots)
        items, seen = [], set()
        for s in slots:
            k = self._key_of[s]
            if k in self._slot_of or k in seen:  # a twin: SlotTier.commit keeps the resident one
                continue
            seen.add(k)
            items.append((k, s, self.block_bytes, self._sum[s]))
        if items:
            self._stale.difference_update(seen)  # a stale delete must never remove the new entry
            self._index_delete([])
            crash_point("index_commit")
            self.index.put(items)

    def _on_evict(self, slots: Sequence[int]) -> None:
        if self.index is not None and not self.read_only:
            self._index_delete([self._key_of[s] for s in slots])

    def _index_delete(self, keys: Sequence[bytes], why: str | None = None) -> None:
        """Delete index entries (quarantine them, with `why`), and any whose delete failed before.

        A failed write (disk full, read-only file system) does not stop an eviction: the stale
        entries are harmless — a reused slot fails the old entry's keyed header check (a miss),
        and opening keeps the newer of two entries on one slot — and are deleted with the next
        index write that succeeds. Logged once per cause, counted always."""
        try:
            if self._stale:
                self.index.delete(sorted(self._stale))
                self._stale.clear()
            if why is None:
                self.index.delete(keys)
            elif keys:
                self.index.quarantine([(k, why) for k in keys])
        except OSError as e:
            self._stale.update(keys)
            self.index_write_errors += 1
            self._count(Metric.INDEX_WRITE_ERRORS.at(self.name))
            self._once(("index_write", e.errno), logging.ERROR, "nvme tier %r: index write failed (%s); %d stale "
                       "entries kept until a write succeeds (they can only miss)", self.name, e, len(self._stale))

    def abort(self, slots: Sequence[int]) -> None:
        super().abort([s for s in slots if s not in self._doomed])

    def free_blocks(self, block_ids: Sequence[int]) -> None:
        super().free_blocks(block_ids)
        doomed = self._doomed
        if doomed:
            for b in block_ids:
                if b in doomed and self._ref[b] == 0:
                    doomed.discard(b)
                    self._release(b)

    def quarantine(self, slots: Sequence[int], why: str = "failed verification") -> int:
        """Blocks that failed verification (read here or on a worker): counted in `corrupt_blocks`,
        their index entries moved to the quarantine, lookups miss. Returns how many."""
        n = len(self.drop(slots, why))
        self.corrupt_blocks += n
        return n

    def drop(self, slots: Sequence[int], why: str | None = None) -> list[bytes]:
        """Remove resident blocks now, pinned or not: index entry deleted (quarantined with `why`
        when given; a read-only tier changes no index), lookup misses.

        Unpinned slots are freed at once; pinned ones when their last pin is released.
        Returns the dropped keys.
        """
        slots = [s for s in dict.fromkeys(slots) if self._state[s] == RESIDENT and s not in self._doomed]
        keys = [self._key_of[s] for s in slots]
        if self.index is not None and keys and not self.read_only:
            self._index_delete(keys, why)
        for s, k in zip(slots, keys):
            del self._slot_of[k]
            self.eviction.on_remove(s, k)
            if self._ref[s] == 0:
                self._release(s)
            else:
                self._state[s] = PENDING_SLOT  # invisible, not evictable, not readable
                self._pending.discard(s)
                self._doomed.add(s)
        return keys

    def summary(self) -> str:
        return f"{super().summary()} at {self.dir}, {self.restored_blocks} restored from disk"

    def stats(self) -> dict:
        d = super().stats()
        d.update({"path": self.dir, "namespace": self.namespace, "slot_stride": self.stride,
                  "corrupt_blocks": self.corrupt_blocks, "restored_blocks": self.restored_blocks,
                  "dropped_on_open": self.dropped_on_open, "fingerprint": dict(self.fingerprint),
                  "read_only": self.read_only, "stored_capacity": self.stored_capacity,
                  "beyond_capacity": self.beyond_capacity, "index_write_errors": self.index_write_errors,
                  "quarantined": self.index.quarantined() if self.index is not None else 0})
        return d

    def close(self) -> None:
        self._close_dir()

    def __enter__(self) -> "NvmeControl":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
