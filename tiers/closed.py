"""A persistent tier that is not open yet: it stands in the controller's list until it is.

The NVMe and shared tiers are keyed by the fingerprint, which names the model by the digest of
its weights; until that digest is done (seconds for multi-GB weights, off the start path) they
must neither serve nor take a block. `ClosedTier` holds nothing, takes nothing (`ready` is
False: the controller plans no copy into it and counts the blocks as `not_open_blocks.<tier>`)
and answers every lookup with a miss (its index is empty); `TierController.open_tier` puts the
real tier in its place.
"""

from __future__ import annotations

from kvtier.policies.lru import LRU

from .base import SlotTier
from .contract import Medium


class ClosedTier(SlotTier):
    """The place of tier `name` (of `medium`; `shared` for the shared tier) while it is closed."""

    kind = "closed"
    ready = False
    dir = None
    capacity_blocks = 0

    def __init__(self, name: str, medium: Medium, shared: bool, block_bytes: int, why: str) -> None:
        super().__init__(name, 1, block_bytes, LRU(1))
        self._free = []               # no slot to allocate
        self.medium = medium
        self.shared = shared
        self.why = why

    def complete_load(self, bad=(), gone=()) -> None:
        """Nothing was loaded from it (in the shared tier's place the blocks would be keys)."""

    def summary(self) -> str:
        return f"{self.name} closed ({self.why})"
