"""The connector's parts built through their public constructors: a scheduler over given tiers
(with the controller the connector's builder makes by default) and a worker's settings."""

from __future__ import annotations

from kvtier.connector.config import load_settings
from kvtier.connector.scheduler import KVTierScheduler, SchedulerOptions
from kvtier.core.controller import TierController
from kvtier.policies import PROMOTION


def scheduler(tiers, block_tokens: int, *, promote: bool = True, admission=None, ranks: int = 1,
              reporters: int | None = None, clock=None, **options) -> KVTierScheduler:
    """`promote`: inclusive promotion or none; `ranks`, `reporters`, `clock`: the controller's;
    `options`: `SchedulerOptions` fields."""
    more = {"clock": clock} if clock is not None else {}
    ctrl = TierController(tiers, block_tokens=block_tokens, admission=admission,
                          promotion=PROMOTION.get("inclusive")() if promote else None, ranks=ranks,
                          reporters=reporters, report_timeout_s=60.0, **more)
    return KVTierScheduler(ctrl, options=SchedulerOptions(**options))


def worker_settings(cpu_blocks: int | None = None, pin: bool = False, **extra):
    """A `KVTierWorker`'s settings: a cpu tier of `cpu_blocks` slots, unpinned, and an nvme tier
    whose data file the scheduler's metadata names (`extra`: kv_connector_extra_config keys)."""
    over = {"cpu_capacity_blocks": cpu_blocks} if cpu_blocks is not None else {}
    return load_settings({**over, "pin": pin, "nvme_path": "/kvtier-test/named-by-the-metadata", **extra})
