"""What the controller has in flight (`InFlight`: stores and copies waiting for an executor's
report) and what it does with the report (`Completion`, a part of
`kvtier.core.controller.TierController`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

from kvtier.core.plan import Report
from kvtier.policies.base import NO_INFO, RequestInfo
from kvtier.tiers.contract import Tier
from kvtier.tiers.counters import Metric

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
    """A store (or a promotion) in flight: its slots are pending until the executor reports them."""

    tier: int
    slots: list[int]
    keys: list[bytes]
    promotion: bool = False
    exclusive_from: tuple[int, list[tuple[int, bytes]]] | None = None  # (lower tier, its copies)
    info: RequestInfo = field(default_factory=lambda: NO_INFO)
    pos: list[int] | None = None      # chain position of each slot (the policies' insert order)

    def commit(self, tier: Tier, good: list[int]) -> None:
        """Commit slots (indices `good`) run by run of consecutive chain positions, each run with
        its own RequestInfo.start, so the eviction policy learns where each block sits."""
        slots, pos = self.slots, self.pos
        if pos is None or self.info is NO_INFO:
            tier.commit([slots[j] for j in good], self.info)
            return
        i = 0
        while i < len(good):
            j = i + 1
            while j < len(good) and pos[good[j]] == pos[good[j - 1]] + 1:
                j += 1
            run = good[i:j]
            info = self.info if pos[run[0]] == self.info.start else replace(self.info, start=pos[run[0]])
            tier.commit([slots[x] for x in run], info)
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
    """Per slot: the checksum (one rank), the tuple of every rank's (several), or -1 when a
    rank failed the write."""
    if ranks == 1:
        sums = next(iter(by_rank.values())) if len(by_rank) == 1 else by_rank.get(0, [])
        return list(sums[:n]) + [-1] * (n - len(sums))
    if sorted(by_rank) != list(range(ranks)):
        log.warning("kvtier: copy reported by ranks %s, expected 0..%d: its %d blocks are not committed",
                    sorted(by_rank), ranks - 1, n)
        return [-1] * n
    cols = [list(by_rank[r][:n]) + [-1] * (n - len(by_rank[r])) for r in range(ranks)]
    return [-1 if -1 in t else t for t in zip(*cols)]


class Completion:
    """`TierController.complete`: an executor's report commits what was written, aborts what
    failed, drops what did not verify, remembers what failed to load and releases the leases of
    loads that finished. (A part of the controller: what is in flight it asks and changes through
    `InFlight`'s methods.)"""

    def complete(self, rep: Report) -> None:
        """The executor's report: commit what was written, abort what failed, drop what did not
        verify, release the leases of loads that finished."""
        for t, n in rep.capacity.items():  # a data plane smaller than configured: before its results
            self._limit(t, n)
        exclusive: list[tuple[int, list[tuple[int, bytes]]]] = []
        for op_id, oks in sorted(rep.stored.items()):  # plan order, whatever order the report has
            st = self.inflight.take_store(op_id)
            if st is None:
                continue
            tier = self.tiers[st.tier]
            good = [j for j, ok in enumerate(oks[:len(st.slots)]) if ok]
            bad = [s for s, ok in zip(st.slots, oks) if not ok] + list(st.slots[len(oks):])
            if good:
                st.commit(tier, good)
                self.failed.forget(st.keys[j] for j in good)
                self._count(Metric.STORED_BLOCKS.at(tier.name), len(good))
                if st.promotion:
                    self._count(Metric.PROMOTED_BLOCKS.at(tier.name), len(good))
                    if st.exclusive_from is not None:
                        lower, src = st.exclusive_from
                        ok_keys = {k for s, k, ok in zip(st.slots, st.keys, oks) if ok}
                        exclusive.append((lower, [(s, k) for s, k in src if k in ok_keys]))
            if bad and st.promotion:  # its read failed (a miss, counted with the read): nothing to promote
                tier.abort(bad)
            elif bad:
                tier.abort(bad)
                self._count(Metric.STORE_FAILED_BLOCKS.at(tier.name), len(bad))
                self.errors.append(f"tier {tier.name}: {len(bad)} of {len(st.slots)} block writes failed")
            self.inflight.landed(st.tier, st.keys)
        self._remember_failed(rep)   # before a bad block's tier quarantines it (its key then gone)
        for t, slots in rep.corrupt.items():  # failed verification on read: a miss from now on
            tier = self.tiers[t]
            tier.quarantine(slots)
            self._count(Metric.CORRUPT_BLOCKS.at(tier.name), len(slots))
        for op_id, by_rank in sorted(rep.written_by_rank().items()):
            self._complete_copy(op_id, by_rank)
        if rep.gone and self.remote is not None:  # found by lookup, gone (or bad) at load: a miss
            self.tiers[self.remote].note_gone(rep.gone)
            self._count(Metric.GONE_BLOCKS.at(self.names[self.remote]), len(rep.gone))
        if rep.bad and self.remote is not None:  # failed verification: remembered, the next lookup misses
            self.tiers[self.remote].note_bad(rep.bad)
            self._count(Metric.BAD_BLOCKS.at(self.names[self.remote]), len(rep.bad))
        for rid, ok in rep.loaded.items():
            self.release(rid)
            if not ok:
                self._count(Metric.LOAD_FAILED_REQUESTS.key)
        for lower, src in exclusive:  # exclusive promotion: the lower copy leaves once read up
            tier = self.tiers[lower]
            gone = [s for s, k in src if tier.find(k) == s and tier.get_block(s).ref_cnt == 0]
            if gone:
                self._evict(lower, gone)

    def _remember_failed(self, rep: Report) -> None:
        """Blocks whose load failed, for any reason: remembered, so no lookup offers them again
        until a fresh copy is written (`kvtier.core.failed_loads`)."""
        for t, blocks in rep.unread.items():
            tier = self.tiers[t]
            keys = list(blocks) if t == self.remote else [k for s in blocks if (k := tier.key_at(s)) is not None]
            new, forgotten = self.failed.add(keys)
            if new:
                self._count(Metric.FAILED_LOAD_BLOCKS.at(tier.name), new)
                self._once(("failed_load", tier.name), logging.WARNING, "kvtier: %d blocks of tier %s failed to "
                           "load: not offered again until rewritten (at most %d remembered; later ones counted in "
                           "failed_load_blocks)", new, tier.name, self.failed.cap)
            if forgotten:
                self._count(Metric.FAILED_LOADS_FORGOTTEN.key, forgotten)
                self._once(("failed_load_cap",), logging.WARNING, "kvtier: more than %d failed loads remembered: "
                           "the oldest are forgotten (may be offered once more; counted in failed_loads_forgotten)",
                           self.failed.cap)

    def _complete_copy(self, op_id: int, by_rank: dict[int, list]) -> None:
        cp = self.inflight.copy_of(op_id)
        if cp is None:
            return
        by_rank = cp.reported(by_rank, self.ranks)   # several ranks: once every rank reported
        if by_rank is None:
            return
        self.inflight.take_copy(op_id)
        tier, src_tier = self.tiers[cp.tier], self.tiers[cp.src_tier]
        sums = rank_sums(by_rank, len(cp.src), self.ranks)
        if tier.remote:  # the server names the blocks: known now, nothing to commit
            self._complete_put(cp, sums)
            return
        good = [(s, c) for s, c in zip(cp.slots, sums) if c != -1]
        bad = [s for s, c in zip(cp.slots, sums) if c == -1]
        if good:
            try:
                tier.commit_written([s for s, _ in good], [c for _, c in good])  # durable: now its index
            except OSError as e:  # e.g. fdatasync failed: nothing indexed, the source copy stays
                self._once(("commit", cp.tier, e.errno), logging.ERROR,
                           "kvtier: tier %s: commit of %d blocks failed, kept in %s: %s (counted in "
                           "store_failed_blocks; later failures of this kind at DEBUG)", tier.name, len(good),
                           src_tier.name, e)
                self.errors.append(f"tier {tier.name}: {e}")
                bad = [s for s, _ in good] + bad
                good = []
            else:
                self._count(Metric.STORED_BLOCKS.at(tier.name), len(good))
                self._count(Metric.DEMOTED_BLOCKS.at(tier.name), len(good))
                self.failed.forget(k for (_, k), c in zip(cp.src, sums) if c != -1)
        if bad:
            tier.abort(bad)
            self._count(Metric.STORE_FAILED_BLOCKS.at(tier.name), len(bad))
            self._count(Metric.IO_ERRORS.at(tier.name), len(bad))
            self.errors.append(f"tier {tier.name}: {len(bad)} of {len(cp.slots)} block writes failed "
                               f"(kept in {src_tier.name}, not indexed)")
        self.inflight.landed(cp.tier, [k for _, k in cp.src])
        for s, k in cp.src:  # unpin the sources that still hold the same block
            src_tier.unpin_if(s, k)

    def _complete_put(self, cp: CopyInFlight, sums: list) -> None:
        tier, src_tier = self.tiers[cp.tier], self.tiers[cp.src_tier]
        good = [k for (_, k), c in zip(cp.src, sums) if c != -1]
        if good:
            tier.note_written(good)
            self.failed.forget(good)
            self._count(Metric.STORED_BLOCKS.at(tier.name), len(good))
        if len(good) < len(cp.src):  # the server refused or was unreachable: counted, not retried
            self._count(Metric.STORE_FAILED_BLOCKS.at(tier.name), len(cp.src) - len(good))
        self.inflight.landed(cp.tier, [k for _, k in cp.src])
        for s, k in cp.src:
            src_tier.unpin_if(s, k)
