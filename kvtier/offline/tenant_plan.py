"""`kvtier plan` per tenant: for a trace whose requests carry a `tenant`, each tenant's own LRU
curve (its requests alone, as if it had the cache to itself) and its hit ratio at its quota of
the top tier (YAML `tenants:`) and at the whole top tier.

A tenant's curve is what it gets from a capacity it holds (its guaranteed share): under quotas a
tenant at least reaches the curve at its quota, and reaches more when others leave room to lend.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import numpy as np

from kvtier.common.units import format_size
from kvtier.offline.sizing import measure
from kvtier.offline.trace import Request

FRACTIONS = (0.01, 0.05, 0.1, 0.2, 0.5, 1.0)   # shares of the tenant's unique blocks
MAX_TENANTS = 16                               # planned one by one (the most referenced); the rest are left out


class ByTenant:
    """Passes a request stream through, keeping the requests that carry a tenant, per tenant."""

    def __init__(self, reqs: Iterable[Request]) -> None:
        self.reqs = reqs
        self.by: dict[str, list[Request]] = {}

    def __iter__(self) -> Iterator[Request]:
        by = self.by
        for r in self.reqs:
            if r.tenant is not None:
                by.setdefault(r.tenant, []).append(r)
            yield r


def plan_tenants(by: dict[str, list[Request]], block_tokens: int, cfg: Any, top: Any, top_cap: int,
                 sample: float | None = None) -> dict:
    """tenant -> {requests, block_refs, unique_blocks, quota_blocks, at_quota, at_top_tier, curve}."""
    quotas: dict[str, int] = {}
    if cfg.tenants is not None and top is not None:
        from kvtier.core.tenants_config import OTHER, quota_blocks
        q = quota_blocks(cfg, top.name, top_cap)
        named = set(cfg.tenants.named())
        quotas = {n: q[n] for n in named}
        default = q[OTHER]
    order = sorted(by, key=lambda n: -sum(len(r.hash_ids) for r in by[n]))
    out: dict[str, Any] = {}
    for name in order[:MAX_TENANTS]:
        sz = measure(by[name], block_tokens, sample, 1, "random", top_cap)
        u = max(1, sz.unique_blocks)
        quota = quotas.get(name, default) if cfg.tenants is not None and top is not None else None
        caps = sorted({max(1, int(f * u)) for f in FRACTIONS})
        at = [c for c in (quota, top_cap) if c]
        hr = sz.hit_ratio(np.array(caps + at, dtype=np.float64))
        d = {"requests": sz.requests, "block_refs": sz.refs, "unique_blocks": sz.unique_blocks,
             "curve": [{"capacity_blocks": c, "hit_ratio": float(r)} for c, r in zip(caps, hr)]}
        if quota is not None:
            d["quota_blocks"] = quota
            d["at_quota"] = float(hr[len(caps)]) if quota else 0.0
        if top_cap:
            d["at_top_tier"] = float(hr[-1])
        out[name] = d
    if len(order) > MAX_TENANTS:
        out["_left_out"] = len(order) - MAX_TENANTS
    return out


def tenant_lines(tenants: dict, top: str | None, block_bytes: int) -> list[str]:
    lines = []
    for name, d in tenants.items():
        if name == "_left_out":
            lines.append(f"  ({d} more tenants not planned one by one)")
            continue
        curve = ", ".join(f"{format_size(p['capacity_blocks'] * block_bytes)} {100 * p['hit_ratio']:.1f}%"
                          for p in d["curve"])
        q = f"; at its quota ({d['quota_blocks']} blocks of {top}) {100 * d['at_quota']:.1f}%" \
            if "quota_blocks" in d else ""
        whole = f"; with all of {top} {100 * d['at_top_tier']:.1f}%" if "at_top_tier" in d else ""
        lines.append(f"  tenant {name}: {d['requests']} requests, {d['block_refs']} block refs, "
                     f"{d['unique_blocks']} unique blocks; alone: {curve}{q}{whole}")
    return lines
