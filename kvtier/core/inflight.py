"""What the controller has in flight (`InFlight`: stores and copies waiting for an executor's
report); `kvtier.core.controller.TierController.complete` asks and changes it through `InFlight`'s
methods when the report comes."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

from kvtier.policies.base import NO_INFO, RequestInfo
from kvtier.tiers.contract import Tier

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

