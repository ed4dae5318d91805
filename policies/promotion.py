"""Promotion policies: on a hit in a lower tier, where the block goes and what stays behind.

Tier 0 is the top (fastest). `target(hit_tier, num_tiers)` names the tier to copy the block
to, or None to serve it in place; `inclusive` says whether the copy below stays.
"""

from __future__ import annotations

from .base import PROMOTION, PromotionPolicy


@PROMOTION.register
class Inclusive(PromotionPolicy):
    """Copy up to the top tier; the lower copy stays (cheap to drop the top copy later)."""

    name = "inclusive"
    inclusive = True

    def target(self, hit_tier: int, num_tiers: int) -> int | None:
        if not 0 <= hit_tier < num_tiers:
            raise ValueError(f"hit_tier {hit_tier} out of range for {num_tiers} tiers")
        return 0 if hit_tier > 0 else None


@PROMOTION.register
class Exclusive(PromotionPolicy):
    """Move up to the top tier; the lower copy is dropped (more unique capacity)."""

    name = "exclusive"
    inclusive = False

    def target(self, hit_tier: int, num_tiers: int) -> int | None:
        if not 0 <= hit_tier < num_tiers:
            raise ValueError(f"hit_tier {hit_tier} out of range for {num_tiers} tiers")
        return 0 if hit_tier > 0 else None


@PROMOTION.register
class NoPromotion(PromotionPolicy):
    """Serve a lower-tier hit in place; nothing is copied up."""

    name = "none"
    inclusive = True

    def target(self, hit_tier: int, num_tiers: int) -> int | None:
        return None
