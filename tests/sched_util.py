"""A scheduler over given tiers, built through the public constructors (`TierController`,
`KVTierScheduler`), with the controller the connector's builder makes by default."""

from __future__ import annotations

from kvtier.connector.scheduler import KVTierScheduler, SchedulerOptions
from kvtier.core.controller import TierController
from kvtier.policies import PROMOTION


def scheduler(tiers, block_tokens: int, *, promote: bool = True, admission=None, ranks: int = 1,
              **options) -> KVTierScheduler:
    """`promote`: inclusive promotion or none; `options`: `SchedulerOptions` fields."""
    ctrl = TierController(tiers, block_tokens=block_tokens, admission=admission,
                          promotion=PROMOTION.get("inclusive")() if promote else None, ranks=ranks)
    return KVTierScheduler(ctrl, options=SchedulerOptions(**options))
