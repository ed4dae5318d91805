"""NVMe tier, control plane: slots, reference counts, eviction order and the durable LMDB index.

It never touches the data file (that is `nvme_data.NvmeData`), so a scheduler in one process
can own it while workers elsewhere move the bytes. Directory layout under `path` (or
`path/ns-<fingerprint hash>` in namespace mode): ``data.0`` (the slots), ``index/`` (LMDB),
``lock`` (flock: one control plane per directory).

A block becomes visible only through `commit`, which writes its index entry (key -> slot,
length, xxh3_64 checksum, generation) after its bytes were written and flushed; at open every
committed entry is served again. The index stores a fingerprint (format version, block bytes,
plus the caller's model, dtype, layout, rank, ...): another fingerprint at `path` raises
`FingerprintMismatch` (on_mismatch="refuse") or opens `path/ns-<hash>` ("namespace"), so
foreign blocks are never served.
"""

from __future__ import annotations

import errno as _errno
import fcntl
import json
import logging
import os
from typing import Sequence

import xxhash

from kvtier.policies.base import EvictionPolicy, RequestInfo, _NO_INFO

from .base import _PENDING, _RESIDENT, SlotTier
from .io_engines import ALIGN, round_up
from .nvme_index import FORMAT_VERSION, NvmeIndex

log = logging.getLogger("kvtier.nvme")

def data_file(rank: int = 0) -> str:
    """The data file of one rank's shards (``data.0`` for a single rank)."""
    return f"data.{rank}"


DATA_FILE = data_file(0)
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


def oserror(e: OSError, what: str, path: str) -> OSError:
    """`e` again, its message naming what failed, the path and the errno."""
    name = _errno.errorcode.get(e.errno, str(e.errno)) if e.errno else "?"
    return OSError(e.errno, f"{what} {path}: [{name}] {e.strerror}", path)


def make_fingerprint(name: str, block_bytes: int, fingerprint: dict | None) -> dict:
    fp = dict(fingerprint or {})
    for k, v in (("block_bytes", block_bytes), ("format_version", FORMAT_VERSION)):
        if k in fp and fp[k] != v:
            raise ValueError(f"tier {name!r}: fingerprint field {k}={fp[k]!r} contradicts the tier's {v!r}")
        fp[k] = v
    return fp


class NvmeControl(SlotTier):
    """Slot tier whose residents are recorded in an LMDB index that survives restarts.

    `commit(slots)` publishes pending slots whose checksums were set (`set_checksums`); a
    subclass that owns the data file flushes it first (`_before_index_put`). `drop` removes
    blocks that failed verification, pinned or not.
    """

    kind = "nvme"

    def __init__(self, name: str, path: str, capacity_blocks: int, block_bytes: int, eviction: EvictionPolicy,
                 fingerprint: dict | None = None, on_mismatch: str = "refuse", open_index: bool = True) -> None:
        if block_bytes <= 0:
            raise ValueError(f"tier {name!r}: block_bytes must be > 0, got {block_bytes}")
        if on_mismatch not in ("refuse", "namespace"):
            raise ValueError(f"tier {name!r}: on_mismatch must be 'refuse' or 'namespace', got {on_mismatch!r}")
        super().__init__(name, capacity_blocks, block_bytes, eviction)
        self.fingerprint = make_fingerprint(name, block_bytes, fingerprint)
        self.stride = round_up(block_bytes, ALIGN)
        self.path = os.path.abspath(path) if path else ""
        self.dir = self.path
        self.namespace: str | None = None
        self.corrupt_blocks = 0
        self.dropped_on_open = 0
        self.restored_blocks = 0
        self.index: NvmeIndex | None = None
        # checksum of each written/resident slot; a tuple (one per rank) when several ranks write shards
        self._sum: list[int | tuple[int, ...]] = [0] * capacity_blocks
        self._doomed: set[int] = set()          # dropped while pinned: freed at ref 0
        self._lock_fd = -1
        self._stored_meta: dict | None = None
        if open_index:
            try:
                self._open_index(on_mismatch)
            except BaseException:
                self.close()
                raise

    # ---- open / recovery ---------------------------------------------------------------
    def _open_index(self, on_mismatch: str) -> None:
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
        self._stored_meta = stored

    def _publish_meta(self) -> None:
        """Record the layout (first open) or the capacity (reopen), then serve the committed entries."""
        if self._stored_meta is None:
            self.index.set_meta({"format_version": str(FORMAT_VERSION), "fingerprint": self.fingerprint,
                                 "slot_stride": str(self.stride), "capacity": str(self._cap)})
        else:
            self.index.set_meta({"capacity": str(self._cap)})
        self._recover()

    def _make_dir(self, d: str) -> None:
        try:
            os.makedirs(d, exist_ok=True)
        except OSError as e:
            raise oserror(e, f"nvme tier {self.name!r}: cannot create directory", d) from None
        probe = os.path.join(d, ".kvtier-probe")
        try:
            os.close(os.open(probe, os.O_CREAT | os.O_WRONLY, 0o644))
            os.unlink(probe)
        except OSError as e:
            raise oserror(e, f"nvme tier {self.name!r}: directory is not writable:", d) from None

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
            good.append((e.generation, e.slot, key, e.sums))
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
    def checksums(self, slots: Sequence[int]) -> list[int | tuple[int, ...]]:
        """The checksums a reader must verify these slots against (per rank: a tuple)."""
        return [self._sum[s] for s in slots]

    def set_checksums(self, slots: Sequence[int], sums: Sequence[int | tuple[int, ...]]) -> None:
        for s, c in zip(slots, sums):
            self._sum[s] = c

    def commit_written(self, slots: Sequence[int], sums: Sequence[int | tuple[int, ...]],
                       info: RequestInfo = _NO_INFO) -> None:
        """These pending slots were written and flushed with these checksums (one per rank when
        several ranks wrote their shards): publish them."""
        self.set_checksums(slots, sums)
        self.commit(slots, info)

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
            self.index.put(items)

    def _on_evict(self, slots: Sequence[int]) -> None:
        if self.index is not None:
            self.index.delete([self._key_of[s] for s in slots])

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
                self._pending.discard(s)
                self._doomed.add(s)
        return keys

    def stats(self) -> dict:
        d = super().stats()
        d.update({"path": self.dir, "namespace": self.namespace, "slot_stride": self.stride,
                  "corrupt_blocks": self.corrupt_blocks, "restored_blocks": self.restored_blocks,
                  "dropped_on_open": self.dropped_on_open, "fingerprint": dict(self.fingerprint)})
        return d

    def close(self) -> None:
        if self.index is not None:
            self.index.close()
            self.index = None
        self._unlock()

    def __enter__(self) -> "NvmeControl":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
