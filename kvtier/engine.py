"""The policy engine: turns the policies' answers into decisions over the tiers' cursors.

It never touches bytes (that is the stack's data plane) and never reaches into a tier's
internals: victims come from the tier's cursor (`free_slots`, the batch form of
`iter_free_blocks`), in the order the eviction policy keeps.
"""

from __future__ import annotations

from typing import Any, Sequence

from kvtier.policies import ADMISSION, EVICTION, PROMOTION, AdmissionPolicy, EvictionPolicy, RequestInfo
from kvtier.policies.base import _NO_INFO

from .config import StackConfig, TierConfig


def policy_params(params: dict[str, Any], name: str) -> dict[str, Any]:
    """The keyword arguments YAML `policy.params` gives policy `name` (none when not a mapping)."""
    p = params.get(name, {})
    return p if isinstance(p, dict) else {}


def make_eviction(cfg: StackConfig, tcfg: TierConfig, capacity: int) -> EvictionPolicy:
    name = tcfg.eviction or cfg.policy.eviction
    return EVICTION.get(name)(capacity, **policy_params(cfg.policy.params, name))


class PolicyEngine:
    """Admission per tier, promotion, and victim selection for a stack of slot tiers."""

    def __init__(self, cfg: StackConfig, tiers: Sequence[Any]) -> None:
        self.tiers = list(tiers)
        storage = cfg.storage_tiers()
        self.admission: list[AdmissionPolicy] = []
        for t in storage:
            name = t.admission or cfg.policy.admission
            self.admission.append(ADMISSION.get(name)(**policy_params(cfg.policy.params, name)))
        self.promotion = PROMOTION.get(cfg.policy.promotion)(**policy_params(cfg.policy.params, cfg.policy.promotion))
        # admission policies that keep eviction history (others inherit the no-op on_evict)
        self._evict_hooks = [type(a).on_evict is not AdmissionPolicy.on_evict for a in self.admission]

    def victims(self, tier_index: int, n: int) -> list[int]:
        """Up to `n` evictable slots of a tier, head of its cursor first."""
        if n <= 0:
            return []
        return self.tiers[tier_index].free_slots(n)

    def admit(self, tier_index: int, keys: Sequence[bytes], info: RequestInfo = _NO_INFO) -> list[bool]:
        return self.admission[tier_index].admit(keys, info)

    def on_evict(self, tier_index: int, keys: Sequence[bytes]) -> None:
        if self._evict_hooks[tier_index]:
            on_evict = self.admission[tier_index].on_evict
            for k in keys:
                on_evict(k)

    def promote_target(self, hit_tier: int) -> int | None:
        return self.promotion.target(hit_tier, len(self.tiers))

    @property
    def inclusive(self) -> bool:
        return self.promotion.inclusive

    def describe(self) -> dict:
        return {"eviction": [t.eviction.name for t in self.tiers],
                "admission": [a.name for a in self.admission],
                "promotion": self.promotion.name}
