"""The YAML `tenants:` section: where a request's tenant comes from and each tenant's quota per tier.

```yaml
tenants:
  key: cache_salt                # or kv_transfer_params.<field>
  quotas:
    alice: {dram: 30%, nvme: 100GiB}
    bob: {dram: 50%}
    default: {dram: 10%}         # every tenant not named, together (counted as `other`)
```

A quota is a size or a share of the tier's capacity; it is the tenant's guaranteed share
(`kvtier.core.tenants`). Quotas apply to the DRAM and NVMe tiers (vLLM owns the GPU pool, the
server owns the shared tier's eviction). A tenant name (a key of `quotas`, and what a request
carries as its tenant) is 1-64 characters of `A-Z a-z 0-9 _ . -`. Errors are one line naming the
field.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvtier.core.errors import ConfigError
from kvtier.common.units import parse_size

DEFAULT = "default"    # the quotas entry of every tenant not named
OTHER = "other"        # the account (and metrics label) of those tenants
MAX_TENANTS = 64       # named tenants (bounded metrics label cardinality)
_KEY = re.compile(r"^(cache_salt|kv_transfer_params\.[A-Za-z0-9_\-]{1,64})$")
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")   # a tenant's name (a metrics label: no `|`, quotes, newlines)


def is_name(v: Any) -> bool:
    return isinstance(v, str) and NAME.fullmatch(v) is not None


def parse_quota(v: Any) -> int | str:
    """A quota: bytes (int) or a share of the tier ('N%', N in [0, 100])."""
    if isinstance(v, str) and v.strip().endswith("%"):
        try:
            p = float(v.strip()[:-1])
        except ValueError:
            raise ValueError(f"{v!r} is not a share (expected e.g. '30%')") from None
        if not 0 <= p <= 100:
            raise ValueError(f"a share must be between 0% and 100%, got {v!r}")
        return f"{p:g}%"
    return parse_size(v)


def share(q: int | str) -> float | None:
    """'30%' -> 0.3; None for a size."""
    return float(q[:-1]) / 100 if isinstance(q, str) else None


class TenantsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    key: str = "cache_salt"
    quotas: dict[str, dict[str, int | str]] = Field(default_factory=dict)

    @field_validator("key")
    @classmethod
    def _key(cls, v: str) -> str:
        if not _KEY.match(v):
            raise ValueError("must be 'cache_salt' or 'kv_transfer_params.<field>'")
        return v

    @field_validator("quotas", mode="before")
    @classmethod
    def _quotas(cls, v: Any) -> Any:
        if not isinstance(v, dict):
            raise ValueError(f"expected a mapping tenant -> {{tier: quota}}, got {type(v).__name__}")
        if len(v) > MAX_TENANTS + 1:
            raise ValueError(f"at most {MAX_TENANTS} named tenants (and {DEFAULT!r}), got {len(v)}")
        out: dict[str, dict[str, int | str]] = {}
        for name, per in v.items():
            if not is_name(name) or name == OTHER:
                raise ValueError(f"{name!r}: a tenant name is 1-64 characters of A-Z a-z 0-9 _ . - "
                                 f"other than {OTHER!r}")
            if not isinstance(per, dict):
                raise ValueError(f"{name}: expected a mapping tier -> quota, got {type(per).__name__}")
            try:
                out[name] = {str(t): parse_quota(q) for t, q in per.items()}
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
        return out

    def named(self) -> list[str]:
        return [n for n in self.quotas if n != DEFAULT]

    @property
    def kv_field(self) -> str | None:
        """The kv_transfer_params field that names the tenant, or None (cache_salt)."""
        return self.key.split(".", 1)[1] if self.key != "cache_salt" else None


def check_tenants(cfg: Any) -> None:
    """Cross-check `cfg.tenants` against the tiers: known cpu/nvme tiers, shares at most 100%."""
    ten = getattr(cfg, "tenants", None)
    if ten is None:
        return
    kinds = {t.name: t.kind for t in cfg.tiers}
    shares: dict[str, float] = {}
    for name, per in ten.quotas.items():
        for tier, q in per.items():
            where = f"{cfg.source}: tenants.quotas.{name}.{tier}"
            if tier not in kinds:
                raise ConfigError(f"{where}: unknown tier {tier!r} (tiers: {', '.join(kinds)})")
            if kinds[tier] not in ("cpu", "nvme"):
                raise ConfigError(f"{where}: quotas apply to cpu and nvme tiers, not a {kinds[tier]} tier "
                                  f"({'vLLM owns its pool' if kinds[tier] == 'gpu' else 'the server owns eviction'})")
            if share(q) is not None:
                shares[tier] = shares.get(tier, 0.0) + share(q)
    for tier, s in shares.items():
        if s > 1.0 + 1e-9:
            raise ConfigError(f"{cfg.source}: tenants.quotas: the shares of tier {tier!r} sum to {s * 100:g}% "
                              f"(at most 100%)")


def quota_blocks(cfg: Any, tier: str, capacity: int, clamp: bool = False) -> dict[str, int]:
    """account -> guaranteed blocks of `tier` (named tenants, then OTHER); sizes and shares resolved
    against `capacity` blocks. A sum over the capacity is a ConfigError, or with `clamp` (a tier
    that shrank at run time) the sizes are scaled down to the room the shares leave."""
    ten = cfg.tenants
    out: dict[str, int] = {}
    sizes: list[str] = []
    for name in ten.named() + [DEFAULT]:
        q = ten.quotas.get(name, {}).get(tier, 0)
        f = share(q)
        acct = OTHER if name == DEFAULT else name
        out[acct] = int(f * capacity) if f is not None else q // cfg.block_bytes
        if f is None:
            sizes.append(acct)
    total = sum(out.values())
    if total > capacity:
        if not clamp:
            raise ConfigError(f"{cfg.source}: tenants.quotas: the quotas of tier {tier!r} sum to {total} blocks, "
                              f"more than its {capacity}")
        asked = sum(out[a] for a in sizes)
        room = capacity - (total - asked)    # the shares sum to at most 100%: room >= 0
        for a in sizes:
            out[a] = out[a] * room // asked
    return out
