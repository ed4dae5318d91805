"""The slot tier: the base of every tier that keeps blocks in slots of its own (CPU, NVMe).

Control plane only (the contracts `contract.Tier` and `contract.SlotTierContract`): which key
lives in which slot, reference counts, the eviction cursor. Bytes move through each tier's data plane (`contract.DataPlane`).

Block life in a slot tier: free -> allocate() -> pending (pinned, invisible to lookup; bytes
being written) -> commit() -> resident (visible; evictable when ref_cnt == 0) -> evict() -> free.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Sequence

from kvtier.policies.base import NO_INFO, EvictionPolicy, RequestInfo

from .contract import BlockView, Medium, Tier

FREE, PENDING_SLOT, RESIDENT = 0, 1, 2


class TierFull(RuntimeError):
    """Not enough free slots; evict first."""


def match_prefix(indexes: Sequence[dict[bytes, int]], keys: Iterable[bytes]) -> tuple[list[int], list[int]]:
    """(tier indices, slots) of the longest prefix of `keys` found in `indexes` (each tier's
    key -> slot map, top tier first); a block in several tiers is taken from the topmost."""
    tiers: list[int] = []
    slots: list[int] = []
    if len(indexes) == 1:
        d = indexes[0]
        for k in keys:
            s = d.get(k)
            if s is None:
                break
            slots.append(s)
        return [0] * len(slots), slots
    for k in keys:
        for ti, d in enumerate(indexes):
            s = d.get(k)
            if s is not None:
                tiers.append(ti)
                slots.append(s)
                break
        else:
            break
    return tiers, slots


def group_by_tier(blocks: Iterable[tuple[int, int]]) -> dict[int, list[int]]:
    """(tier, slot) pairs -> {tier: its slots, in order}."""
    out: dict[int, list[int]] = {}
    for t, s in blocks:
        lst = out.get(t)
        if lst is None:
            lst = out[t] = []
        lst.append(s)
    return out


def _no_count(key: str, v: float = 1) -> None:
    pass


class SlotTier(Tier):
    """Fixed-size slots, a key index, reference counts and an eviction policy.

    Subclasses (CPU, NVMe) add a data plane and may persist commits/evictions
    through `_on_commit` / `_on_evict`.
    """

    kind = "slots"
    # what the tier declares (the controller and the drivers read these, never probe for methods)
    medium = Medium.HOST   # what holds its bytes (the data plane's medium)
    shared = False         # the shared tier: its server owns membership and eviction (tiers.shared)
    verifies = False       # a load carries each block's expected checksum (checksums(slots))
    data_plane = None      # the object that holds the bytes in this process, or None
    ready = True           # open: serves and takes blocks (tiers.closed.ClosedTier: not yet)

    def __init__(self, name: str, capacity_blocks: int, block_bytes: int, eviction: EvictionPolicy) -> None:
        if capacity_blocks <= 0:
            raise ValueError(f"tier {name!r}: capacity must hold at least one block of {block_bytes} bytes")
        self.name = name
        self.block_bytes = block_bytes
        self._cap = capacity_blocks
        self.eviction = eviction
        self._slot_of: dict[bytes, int] = {}
        self._key_of: list[bytes | None] = [None] * capacity_blocks
        self._ref = [0] * capacity_blocks
        self._state = bytearray(capacity_blocks)
        self._free: list[int] = list(range(capacity_blocks - 1, -1, -1))
        self._pending: set[int] = set()
        self._count: Callable[..., None] = _no_count

    def bind_counter(self, count: Callable[..., None]) -> None:
        """Count this tier's own events (e.g. `index_write_errors.<name>`) into the controller's counters."""
        self._count = count

    # ---- sizes -------------------------------------------------------------------------
    @property
    def capacity_blocks(self) -> int:
        return self._cap

    @property
    def num_used(self) -> int:
        """Resident + pending slots."""
        return self._cap - len(self._free)

    @property
    def num_resident(self) -> int:
        return len(self._slot_of)

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def occupancy(self) -> float:
        return self.num_used / self._cap

    # ---- lookups -----------------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes], wait: bool = True) -> int:
        """Length of the prefix of `keys` resident here (never pending). No side effects."""
        d = self._slot_of
        n = 0
        for k in keys:
            if k not in d:
                break
            n += 1
        return n

    @property
    def resident(self) -> dict[bytes, int]:
        """key -> slot of the resident blocks (the live dict: read it, never write it)."""
        return self._slot_of

    def find(self, key: bytes) -> int | None:
        return self._slot_of.get(key)

    def holds(self, key: bytes) -> bool:
        """Resident here (a slot tier knows its blocks exactly)."""
        return key in self._slot_of

    def __contains__(self, key: bytes) -> bool:
        return key in self._slot_of

    def keys(self) -> list[bytes]:
        return list(self._slot_of)

    def get_block(self, block_id: int) -> BlockView:
        return BlockView(block_id, self._ref[block_id], self._key_of[block_id], False)

    def key_at(self, slot: int) -> bytes | None:
        """The key a slot holds (resident or pending), None when free."""
        return self._key_of[slot]

    def pinned_blocks(self) -> int:
        """Sum of reference counts (pins) over the slots."""
        return sum(self._ref)

    # ---- reference counts --------------------------------------------------------------
    def touch(self, block_ids: Sequence[int]) -> None:
        """Pin: a block with ref_cnt > 0 is never yielded by the cursor nor evicted."""
        ref, st = self._ref, self._state
        for b in block_ids:
            if st[b] == FREE:
                raise KeyError(f"tier {self.name!r}: touch of free slot {b}")
            ref[b] += 1

    def free_blocks(self, block_ids: Sequence[int]) -> None:
        ref = self._ref
        for b in block_ids:
            if ref[b] <= 0:
                raise ValueError(f"tier {self.name!r}: free_blocks on slot {b} with ref_cnt {ref[b]}")
            ref[b] -= 1

    def unpin_if(self, slot: int, key: bytes) -> bool:
        """free_blocks([slot]) when the slot still holds `key` and is pinned (a pin taken for a
        transfer whose slot may have been aborted and reused since)."""
        if self._key_of[slot] == key and self._ref[slot] > 0:
            self.free_blocks([slot])
            return True
        return False

    def hit(self, block_ids: Sequence[int], info: RequestInfo = NO_INFO) -> None:
        """Record a use (reorders the eviction cursor)."""
        self.eviction.on_hit(block_ids, info)

    def prepare_load(self, slots: Sequence[int], keys: Sequence[bytes], verify: bool,
                     info: RequestInfo = NO_INFO) -> tuple[list | None, list | None]:
        """A load of these blocks: the use recorded (`hit`); returns what it carries: (expected
        tags, keys) when the tier verifies and `verify`, else (None, None)."""
        fields = (self.checksums(slots), list(keys)) if verify and self.verifies else (None, None)
        self.hit(slots, info)
        return fields

    def complete_load(self, bad: Sequence[int] = (), gone: Sequence[int] = ()) -> None:
        """Slots a load found bad (failed verification) or gone: quarantined (`quarantine`)."""
        self.quarantine(bad)
        if gone:
            self.quarantine(gone, "gone at load")

    # ---- the cursor --------------------------------------------------------------------
    def iter_free_blocks(self, after: BlockView | int | None = None) -> Iterator[BlockView]:
        """Evictable blocks (resident, ref_cnt == 0) in eviction order.

        Resumes after `after` while that block is still evictable; otherwise restarts
        from the head.
        """
        start = after.block_id if isinstance(after, BlockView) else after
        if start is not None and (self._state[start] != RESIDENT or self._ref[start] != 0):
            start = None
        ref, keys = self._ref, self._key_of
        for s in self.eviction.victims(start):
            if ref[s] == 0:
                yield BlockView(s, 0, keys[s], False)

    def iter_free_slots(self) -> Iterator[int]:
        """Fast path of iter_free_blocks: slot ids only."""
        ref = self._ref
        for s in self.eviction.victims(None):
            if ref[s] == 0:
                yield s

    def free_slots(self, n: int) -> list[int]:
        """The first `n` slots of iter_free_slots(), as a list (the engine's batch path)."""
        return self.eviction.take_victims(n, self._ref)

    # ---- allocation --------------------------------------------------------------------
    def allocate(self, keys: Sequence[bytes], info: RequestInfo = NO_INFO) -> list[int]:
        """Reserve a pinned, invisible slot per key; commit() publishes them."""
        free, slot_of = self._free, self._slot_of
        if len(keys) > len(free):
            raise TierFull(f"tier {self.name!r}: {len(keys)} blocks asked, {len(free)} slots free")
        if not slot_of.keys().isdisjoint(keys):
            k = next(k for k in keys if k in slot_of)
            raise ValueError(f"tier {self.name!r}: key {k.hex()} is already resident")
        cut = len(free) - len(keys)
        slots = free[cut:]
        slots.reverse()             # the order free.pop() would give them in
        del free[cut:]
        state, key_of, ref = self._state, self._key_of, self._ref
        for s, k in zip(slots, keys):
            state[s] = PENDING_SLOT
            key_of[s] = k
            ref[s] = 1
        self._pending.update(slots)
        return slots

    def commit(self, slots: Sequence[int], info: RequestInfo = NO_INFO) -> None:
        """Pending -> resident: visible to lookup, evictable once unpinned."""
        state = self._state
        if not self._pending.issuperset(slots):  # the fast check; this loop finds the culprit
            for s in slots:
                if state[s] != PENDING_SLOT:
                    raise ValueError(f"tier {self.name!r}: commit of slot {s} that is not pending")
        self._on_commit(slots)
        slot_of, key_of, ref = self._slot_of, self._key_of, self._ref
        keys = [key_of[s] for s in slots]
        new = list(slots)
        if not slot_of.keys().isdisjoint(keys) or len(set(keys)) < len(keys):
            new, keys = [], []
            for s in slots:
                k = key_of[s]
                if k in slot_of:  # a twin committed meanwhile: keep the old one
                    self._release(s)
                    continue
                slot_of[k] = s
                new.append(s)
                keys.append(k)
        else:
            slot_of.update(zip(keys, slots))
        for s in new:
            state[s] = RESIDENT
            ref[s] -= 1
        if new:
            self._pending.difference_update(new)
            self.eviction.on_insert(new, keys, info)

    def abort(self, slots: Sequence[int]) -> None:
        """Pending -> free (the write failed or was cancelled)."""
        for s in slots:
            if self._state[s] == PENDING_SLOT:
                self._release(s)

    def _release(self, s: int) -> None:
        self._pending.discard(s)
        self._state[s] = FREE
        self._key_of[s] = None
        self._ref[s] = 0
        if s < self._cap:  # a slot beyond a limit() retires
            self._free.append(s)

    def limit(self, n: int) -> list[bytes]:
        """Hold at most `n` slots from now on: the data plane behind this tier has fewer than
        configured (a worker shrank its pool to fit memory). Free slots from `n` up retire now,
        resident unpinned ones are evicted (their keys returned), pinned or pending ones retire
        when released. Never grows the tier."""
        if n >= self._cap or n < 1:
            return []
        self._cap = n
        self._free = [s for s in self._free if s < n]
        gone = [s for s in range(n, len(self._state)) if self._state[s] == RESIDENT and self._ref[s] == 0]
        return self.evict(gone) if gone else []

    def evict(self, block_ids: Sequence[int]) -> list[bytes]:
        """Drop resident, unpinned blocks; returns their keys."""
        state, ref, key_of = self._state, self._ref, self._key_of
        out = []
        for s in block_ids:
            if state[s] != RESIDENT:
                raise ValueError(f"tier {self.name!r}: evict of slot {s} that is not resident")
            if ref[s]:
                raise ValueError(f"tier {self.name!r}: evict of pinned slot {s} (ref_cnt {ref[s]})")
            out.append(key_of[s])
        self._on_evict(block_ids)
        slot_of = self._slot_of
        for s, k in zip(block_ids, out):  # resident and unpinned: releasing is state + key only
            del slot_of[k]
            state[s] = FREE
            key_of[s] = None
        self.eviction.on_remove_many(block_ids, out)
        cap = self._cap
        self._free.extend(s for s in block_ids if s < cap)
        return out

    def _restore(self, entries: Sequence[tuple[int, bytes]]) -> None:
        """Mark (slot, key) pairs resident at open time (persistent tiers), oldest first."""
        slots, keys = [], []
        for s, k in entries:
            self._state[s] = RESIDENT
            self._key_of[s] = k
            self._slot_of[k] = s
            slots.append(s)
            keys.append(k)
        self._free = [s for s in range(self._cap - 1, -1, -1) if self._state[s] == FREE]
        on_insert = self.eviction.on_insert
        for s, k in zip(slots, keys):  # one by one: no request's order to apply, the oldest leaves first
            on_insert([s], [k])

    # ---- persistence hooks -------------------------------------------------------------
    def _on_commit(self, slots: Sequence[int]) -> None:
        pass

    def _on_evict(self, slots: Sequence[int]) -> None:
        pass

    # ---- the rest of the contract, with what a plain DRAM tier does --------------------------
    @property
    def eviction_name(self) -> str:
        return self.eviction.name

    def checksums(self, slots: Sequence[int]) -> list:
        """What a reader verifies each slot against (`verifies` tiers only)."""
        return [0] * len(slots)

    def commit_written(self, slots: Sequence[int], sums: Sequence, info: RequestInfo = NO_INFO) -> None:
        """Pending slots an executor wrote (with these checksums): publish them."""
        self.commit(slots, info)

    def complete_store(self, slots: Sequence[int], keys: Sequence[bytes], sums: Sequence,
                       info: RequestInfo = NO_INFO) -> None:
        """Copies into pending `slots` ended (`sums[i]`: slot i's checksum, -1: its write failed):
        the written ones published (`commit_written`: an OSError publishes none and leaves every
        slot pending for the caller to `abort`), then the failed ones aborted."""
        good = [(s, c) for s, c in zip(slots, sums) if c != -1]
        if good:
            self.commit_written([s for s, _ in good], [c for _, c in good], info)
        bad = [s for s, c in zip(slots, sums) if c == -1]
        if bad:
            self.abort(bad)

    def quarantine(self, slots: Sequence[int], why: str = "failed verification") -> int:
        """Blocks that failed verification: out of service (a miss from now on); returns how many.
        DRAM blocks are not verified: the unpinned ones are evicted."""
        gone = [s for s in dict.fromkeys(slots) if self._state[s] == RESIDENT and self._ref[s] == 0]
        return len(self.evict(gone)) if gone else 0

    def summary(self) -> str:
        """The tier in a start-up line: name, capacity and what else an operator needs to know."""
        from kvtier.common.units import format_size
        return f"{self.name} {self._cap} blocks ({format_size(self._cap * self.block_bytes)})"

    def stats(self) -> dict:
        return {"name": self.name, "kind": self.kind, "capacity_blocks": self._cap,
                "resident_blocks": len(self._slot_of), "pending_blocks": len(self._pending),
                "block_bytes": self.block_bytes, "occupancy": round(self.occupancy, 4),
                "eviction": self.eviction.name}
