"""What the controller owes and awaits, in three ledgers it owns: leases (`LeaseTable`: pins
between lookup and load), transfers in flight (`InFlight`: stores and copies awaiting an
executor's report) and failed loads (`FailedLoads`: not offered until rewritten). The controller
(`kvtier.core.controller.TierController`) asks and changes them through their methods only.

Leases: pins on matched lower-tier blocks between lookup and load.

vLLM asks how many tokens match (maybe many times), then allocates, then tells the accepted
count. A lease pins the matched blocks from the first ask; asking again for the same request
and range never pins twice; commit keeps the accepted prefix and releases the rest; release
(finish, preemption, abort, not chosen) or expiry unpins everything.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Sequence

from kvtier.policies.base import NO_INFO, RequestInfo
from kvtier.tiers.contract import SlotTierContract


@dataclass
class Lease:
    request_id: str
    start: int                       # chain position of the first leased block
    keys: tuple[bytes, ...]          # the keys asked for (from start)
    blocks: list[tuple[int, int]]    # (tier index, slot) per matched block, in prefix order
    deadline: float
    committed: bool = False

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


@dataclass
class LeaseTable:
    """Lease bookkeeping; `pin` / `unpin` take [(tier, slot)] and do the tiers' ref counts."""

    pin: Callable[[Sequence[tuple[int, int]]], None]
    unpin: Callable[[Sequence[tuple[int, int]]], None]
    timeout_s: float = 60.0
    clock: Callable[[], float] = time.monotonic
    leases: dict[str, Lease] = field(default_factory=dict)
    expired: int = 0

    def __len__(self) -> int:
        """Requests holding a lease."""
        return len(self.leases)

    def get(self, request_id: str, start: int, keys: Sequence[bytes]) -> Lease | None:
        """The live lease for exactly this request and range, if any."""
        lease = self.leases.get(request_id)
        if lease is not None and lease.start == start and lease.keys == tuple(keys):
            return lease
        return None

    def take(self, request_id: str, start: int, keys: Sequence[bytes], blocks: list[tuple[int, int]]) -> Lease:
        """Pin `blocks` for the request, replacing any lease it held on another range."""
        self.release(request_id)
        self.pin(blocks)
        lease = Lease(request_id, start, tuple(keys), blocks, self.clock() + self.timeout_s)
        self.leases[request_id] = lease
        return lease

    def commit(self, request_id: str, num_blocks: int) -> Lease | None:
        """Keep the first `num_blocks` pinned (until release), unpin the rest; 0 releases all."""
        lease = self.leases.get(request_id)
        if lease is None:
            return None
        if num_blocks <= 0:
            self.release(request_id)
            return None
        num_blocks = min(num_blocks, lease.num_blocks)
        self.unpin(lease.blocks[num_blocks:])
        del lease.blocks[num_blocks:]
        lease.keys = lease.keys[:num_blocks]
        lease.committed = True
        return lease

    def held(self, request_id: str) -> int:
        """Blocks the request's lease pins (0: no lease)."""
        lease = self.leases.get(request_id)
        return lease.num_blocks if lease is not None else 0

    def release(self, request_id: str) -> int:
        lease = self.leases.pop(request_id, None)
        if lease is None:
            return 0
        self.unpin(lease.blocks)
        return lease.num_blocks

    def expire(self, now: float | None = None) -> list[str]:
        """Release leases past their deadline; returns their request ids."""
        now = self.clock() if now is None else now
        stale = [r for r, l in self.leases.items() if l.deadline <= now]
        for r in stale:
            self.release(r)
        self.expired += len(stale)
        return stale

    def pinned(self) -> int:
        return sum(l.num_blocks for l in self.leases.values())


# ---- transfers in flight -----------------------------------------------------------------------------
# What the controller has in flight (`InFlight`: stores and copies waiting for an executor's
# report); `kvtier.core.controller.TierController.complete` asks and changes it through `InFlight`'s
# methods when the report comes.
log = logging.getLogger("kvtier.core.controller")


class Pending:
    def __repr__(self) -> str:
        return "PENDING"


PENDING = Pending()   # acquire(wait=False): the shared tier's answer is on its way; ask again


@dataclass
class CopyInFlight:
    """A tier-to-tier copy in flight: sources stay pinned until the target is durable."""

    src_tier: int
    src: list[tuple[int, bytes]]      # (slot, key) in the source tier
    tier: int
    slots: list[int]                  # in the target tier (none for the shared tier)
    reports: dict[int, list] = field(default_factory=dict)  # rank -> checksums (several ranks)

    def reported(self, by_rank: dict[int, list], ranks: int) -> dict[int, list] | None:
        """Add ranks' reports; every rank's once all of `ranks` reported (ranks write behind on their
        own clocks), else None."""
        if ranks <= 1:
            return by_rank
        self.reports.update(by_rank)
        return self.reports if len(self.reports) >= ranks else None


@dataclass
class StoreInFlight:
    """A store (or a promotion) in flight: its slots are pending until every rank reported them
    (each rank copies into its own pool, on its own clock: reports come in different steps)."""

    tier: int
    slots: list[int]
    keys: list[bytes]
    promotion: bool = False
    exclusive_from: tuple[int, list[tuple[int, bytes]]] | None = None  # (lower tier, its copies)
    info: RequestInfo = field(default_factory=lambda: NO_INFO)
    pos: list[int] | None = None      # chain position of each slot (the policies' insert order)
    deadline: float = float("inf")    # aborted when some rank has not reported it by then
    reports: dict[int, list[bool]] = field(default_factory=dict)  # rank -> per-block ok, so far
    tags: dict[int, list[int]] = field(default_factory=dict)      # a store into a file: rank -> per-block tag

    def reported(self, by_rank: dict[int, list[bool]], ranks: int,
                 tags: dict[int, list[int]] | None = None) -> list[bool] | None:
        """Add ranks' reports (ranks 0..`ranks`-1; a rank reporting twice: ANDed) and, for a store
        into a file, their tags; once every rank reported, per block whether every rank stored it,
        else None. A failure decides the outcome but not the moment: another rank may still be
        copying the same blocks."""
        if ranks <= 1:  # one worker, whatever its rank
            by_rank = {0: oks for oks in by_rank.values()}
            tags = {0: t for t in (tags or {}).values()}
        for r, t in (tags or {}).items():
            if 0 <= r < ranks:
                self.tags[r] = list(t)
        for r, oks in by_rank.items():
            if 0 <= r < ranks:
                mine = self.reports.get(r)
                self.reports[r] = list(oks) if mine is None else [a and b for a, b in zip(mine, oks)]
        if len(self.reports) < ranks:
            return None
        n = len(self.slots)
        cols = [list(oks[:n]) + [False] * (n - len(oks)) for oks in self.reports.values()]
        return [all(t) for t in zip(*cols)]

    def sums(self, ranks: int) -> list | None:
        """A store into a file: per block its tag (several ranks: the tuple of theirs; -1: some
        rank did not write it); None for a store whose report carries no tags (DRAM)."""
        if not self.tags:
            return None
        return rank_sums({r: t for r, t in self.tags.items() if r < ranks}, len(self.slots), ranks)

    def commit(self, tier: SlotTierContract, good: list[int], sums: list | None = None) -> None:
        """Commit slots (indices `good`) run by run of consecutive chain positions, each run with
        its own RequestInfo.start, so the eviction policy learns where each block sits. `sums`
        (a store into a file, `self.sums`): written and flushed with these tags, published."""
        slots, pos = self.slots, self.pos

        def publish(run: list[int], info: RequestInfo) -> None:
            if sums is None:
                tier.commit([slots[x] for x in run], info)
            else:
                tier.commit_written([slots[x] for x in run], [sums[x] for x in run], info)
        if pos is None or self.info is NO_INFO:
            publish(good, self.info)
            return
        i = 0
        while i < len(good):
            j = i + 1
            while j < len(good) and pos[good[j]] == pos[good[j - 1]] + 1:
                j += 1
            run = good[i:j]
            info = self.info if pos[run[0]] == self.info.start else replace(self.info, start=pos[run[0]])
            publish(run, info)
            i = j


class InFlight:
    """The controller's transfers awaiting a report: stores (and promotions) and copies by op id,
    and per tier the keys on their way in."""

    def __init__(self, ntiers: int) -> None:
        self._stores: dict[int, StoreInFlight] = {}
        self._copies: dict[int, CopyInFlight] = {}
        self._incoming: list[set[bytes]] = [set() for _ in range(ntiers)]

    def __len__(self) -> int:
        return len(self._stores) + len(self._copies)

    @property
    def stores(self) -> int:
        return len(self._stores)

    @property
    def copies(self) -> int:
        return len(self._copies)

    def add_store(self, op_id: int, st: StoreInFlight) -> None:
        self._incoming[st.tier].update(st.keys)
        self._stores[op_id] = st

    def add_copy(self, op_id: int, cp: CopyInFlight) -> None:
        self._incoming[cp.tier].update(k for _, k in cp.src)
        self._copies[op_id] = cp

    def take_store(self, op_id: int) -> StoreInFlight | None:
        return self._stores.pop(op_id, None)

    def store_of(self, op_id: int) -> StoreInFlight | None:
        return self._stores.get(op_id)

    def overdue_stores(self, now: float) -> list[int]:
        """Op ids of the stores past their deadline (some rank never reported them)."""
        return [op for op, st in self._stores.items() if st.deadline <= now]

    def copy_of(self, op_id: int) -> CopyInFlight | None:
        return self._copies.get(op_id)

    def take_copy(self, op_id: int) -> CopyInFlight | None:
        return self._copies.pop(op_id, None)

    def landed(self, tier: int, keys) -> None:
        """These keys are no longer on their way into `tier` (committed or failed)."""
        self._incoming[tier].difference_update(keys)

    def incoming(self, tier: int, key: bytes) -> bool:
        return key in self._incoming[tier]

    def copying_blocks(self) -> int:
        """Blocks of the copies in flight."""
        return sum(len(c.src) for c in self._copies.values())


def rank_sums(by_rank: dict[int, list], n: int, ranks: int) -> list:
    """Per slot: the checksum (one rank), the tuple of every rank's (several; a rank's own tuple
    when it writes several parts, flattened in rank order), or -1 when a rank failed the write."""
    if ranks == 1:
        sums = next(iter(by_rank.values())) if len(by_rank) == 1 else by_rank.get(0, [])
        return list(sums[:n]) + [-1] * (n - len(sums))
    if sorted(by_rank) != list(range(ranks)):
        log.warning("kvtier: copy reported by ranks %s, expected 0..%d: its %d blocks are not committed",
                    sorted(by_rank), ranks - 1, n)
        return [-1] * n
    cols = [list(by_rank[r][:n]) + [-1] * (n - len(by_rank[r])) for r in range(ranks)]
    out: list = []
    for t in zip(*cols):   # a rank holding several parts reports a tuple: the parts in rank order
        flat = tuple(c for x in t for c in (x if isinstance(x, tuple) else (x,)))
        out.append(-1 if -1 in flat else flat)
    return out


# ---- failed loads ------------------------------------------------------------------------------------
# Blocks whose load failed (`FailedLoads`, held by the controller): not offered until rewritten.
#
# A load that fails for any reason (an I/O error such as EIO or EISDIR, a file that cannot be
# opened, a short read, a failed verification or decryption, a shared-tier value gone or bad, a
# copy into the KV that failed) is a load error, recomputed by vLLM, and its blocks' keys are
# remembered here. The controller's lookups (`TierController.match`, `find`) end a hit at a
# remembered key, on every tier, for every caller: a request vLLM sends back to the lookup after
# a failed load (a hybrid model's or a shared-tier hit's asynchronous load) is not offered the same
# blocks again. A fresh store of a key (a store, copy or put reported written, into any tier)
# forgets it; the fresh copy is then found first, and once it is evicted an unreadable older copy
# below may be offered once more (and, failing again, remembered again).
#
# What stays where: a block that failed verification is also quarantined by its tier (out of the
# index); a block that could not be read keeps its index entry and its bytes (I/O errors keep the
# data where it was: the error may pass, and a restart or `fsck` reads it again): it is only not
# offered while remembered. The copies in other tiers are untouched.
#
# Bounded: at most `cap` keys, least recently failed forgotten first (counted in
# `failed_loads_forgotten`); a forgotten block may be offered once more and, when it fails again,
# is remembered again. The memory is per process: after a restart such a block is offered once.
DEFAULT_CAP = 1 << 16   # keys (~10 MiB at most)


class FailedLoads:
    """A capped LRU set of keys whose load failed."""

    def __init__(self, cap: int = DEFAULT_CAP) -> None:
        if cap < 1:
            raise ValueError(f"failed-load memory needs room for one key, got cap={cap}")
        self.cap = cap
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: bytes) -> bool:
        return key in self._keys

    def add(self, keys: Iterable[bytes]) -> tuple[int, int]:
        """Remember `keys`: (how many were new, how many older keys the cap made forget)."""
        new = forgotten = 0
        for k in keys:
            if k in self._keys:
                self._keys.move_to_end(k)
                continue
            self._keys[k] = None
            new += 1
            if len(self._keys) > self.cap:
                self._keys.popitem(last=False)
                forgotten += 1
        return new, forgotten

    def forget(self, keys: Iterable[bytes]) -> int:
        """A fresh copy of these keys was written: offered again. Returns how many were remembered."""
        if not self._keys:
            return 0
        n = 0
        for k in keys:
            if self._keys.pop(k, 0) is None:
                n += 1
        return n

    def clean(self, keys: Sequence[bytes], n: int | None = None) -> int:
        """Length of the prefix of `keys[:n]` with no remembered key."""
        n = len(keys) if n is None else n
        if self._keys:
            for i in range(n):
                if keys[i] in self._keys:
                    return i
        return n
