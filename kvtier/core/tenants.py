"""Tenants on one cache: who owns each block of each local tier, quotas, per-tenant counters.

An account is a named tenant (YAML `tenants.quotas`) or `other` (every tenant not named, and
requests without one, together). A block is charged to the account that stored it; copies down
and promotions keep that owner. A tier's quota per account (`tenants_config.quota_blocks`) is a
guaranteed share of its slots, re-derived whenever the tier's capacity changes (`Tenants.attach`):

- free room is anyone's (unused quota is lent out);
- a tenant that stays within its quota after the store takes its room from the accounts over
  theirs (borrowers, the one furthest over first): quota is reclaimed;
- a tenant at or over its quota evicts its own blocks first, then borrowers', never a block of
  an account at or under its quota: a burst never pushes another tenant below its share;
- without such a victim the block is not stored (counted as dropped).

Each account has its own instance of the tier's eviction policy (`TenantEviction`), so lru, arc
and s3fifo order the blocks within a tenant as they would a whole tier.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator, Sequence

from kvtier.core.errors import ConfigError
from kvtier.core.tenants_config import OTHER, is_name, quota_blocks
from kvtier.tiers.contract import SlotTierContract
from kvtier.policies.base import NO_INFO, EvictionPolicy, RequestInfo
from kvtier.common.counters import Metric
from kvtier.common.once import Once

log = logging.getLogger("kvtier.core.tenants")


def _no_count(key: str, v: float = 1) -> None:
    pass


class TenantEviction(EvictionPolicy):
    """A tier's eviction policy split by account: `subs[a]` orders account a's blocks."""

    def __init__(self, capacity: int, subs: Sequence[EvictionPolicy], quotas: Sequence[int],
                 labels: Sequence[str], tier: str, count: Callable[..., None] = _no_count) -> None:
        super().__init__(capacity)
        self.subs = list(subs)
        self.quotas = list(quotas)
        self.labels = list(labels)
        self.tier = tier
        self.usage = [0] * len(subs)
        self.owner = [-1] * capacity         # account of each resident slot
        self.claimed = [-1] * capacity       # account a pending slot will belong to (set at allocate)
        self.count = count
        self.name = subs[0].name  # type: ignore[misc]

    def requota(self, capacity: int, quotas: Sequence[int]) -> None:
        """The tier now holds `capacity` slots: these are the accounts' quotas. Slots beyond it
        (pinned or pending when the tier shrank) keep their owner until released."""
        self.capacity = capacity
        self.quotas = list(quotas)

    # ---- the policy calls -----------------------------------------------------------------
    def _groups(self, slots: Sequence[int], acct: Callable[[int], int]) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for i, s in enumerate(slots):
            out.setdefault(acct(s), []).append(i)
        return out

    def on_insert(self, slots: Sequence[int], keys: Sequence[bytes], info: RequestInfo = NO_INFO) -> None:
        dflt = len(self.subs) - 1
        claimed, owner = self.claimed, self.owner
        for a, idx in self._groups(slots, lambda s: claimed[s] if claimed[s] >= 0 else dflt).items():
            ss = [slots[i] for i in idx]
            for s in ss:
                owner[s] = a
                claimed[s] = -1
            self.usage[a] += len(ss)
            self.subs[a].on_insert(ss, [keys[i] for i in idx], info)
            self.count(Metric.TENANT_STORED_BLOCKS.at(self.tier, self.labels[a]), len(ss))

    def on_hit(self, slots: Sequence[int], info: RequestInfo = NO_INFO) -> None:
        owner = self.owner
        for a, idx in self._groups(slots, lambda s: owner[s]).items():
            if a >= 0:
                self.subs[a].on_hit([slots[i] for i in idx], info)

    def on_remove(self, slot: int, key: bytes) -> None:
        self.on_remove_many([slot], [key])

    def on_remove_many(self, slots: Sequence[int], keys: Sequence[bytes]) -> None:
        owner = self.owner
        for a, idx in self._groups(slots, lambda s: owner[s]).items():
            if a < 0:
                continue
            ss = [slots[i] for i in idx]
            self.subs[a].on_remove_many(ss, [keys[i] for i in idx])
            for s in ss:
                owner[s] = -1
            self.usage[a] -= len(ss)
            self.count(Metric.TENANT_EVICTED_BLOCKS.at(self.tier, self.labels[a]), len(ss))

    def contains(self, slot: int) -> bool:
        return self.owner[slot] >= 0

    def _by_excess(self) -> list[int]:
        """Accounts, the one furthest over its quota first."""
        return sorted(range(len(self.subs)), key=lambda a: self.quotas[a] - self.usage[a])

    def victims(self, after: int | None = None) -> Iterator[int]:
        """Every account's victims, the account furthest over its quota first (a quota-blind
        caller's order: write-back's cleaning ahead)."""
        order = self._by_excess()
        a0 = self.owner[after] if after is not None and after >= 0 else -1
        if a0 >= 0:
            order = order[order.index(a0):]
        for a in order:
            yield from self.subs[a].victims(after if a == a0 else None)

    def take_victims(self, n: int, pinned: Sequence[int]) -> list[int]:
        out: list[int] = []
        for a in self._by_excess():
            if len(out) >= n:
                break
            out.extend(self.subs[a].take_victims(n - len(out), pinned))
        return out

    # ---- the quota ------------------------------------------------------------------------
    def choose(self, ask: Sequence[int], pinned: Sequence[int], free: Sequence[int] = ()) -> list[int]:
        """Up to len(`ask`) victims, one for each block to store (`ask`: the account of each), once
        the blocks of accounts `free` took the free slots (module docstring)."""
        usage = list(self.usage)
        for a in free:
            usage[a] += 1
        n = len(ask)
        quota = self.quotas
        cand: dict[int, list[int]] = {}
        pos: dict[int, int] = {}

        def take(a: int) -> int | None:
            lst = cand.get(a)
            if lst is None:
                lst = cand[a] = self.subs[a].take_victims(n, pinned)
                pos[a] = 0
            i = pos[a]
            if i >= len(lst):
                return None
            pos[a] = i + 1
            return lst[i]

        out: list[int] = []
        for asker in ask:
            borrowers = [b for b in sorted(range(len(usage)), key=lambda b: quota[b] - usage[b])
                         if b != asker and usage[b] > quota[b]]
            # within its quota after this block: reclaim from borrowers first; else its own first
            order = borrowers + [asker] if usage[asker] < quota[asker] else [asker] + borrowers
            for b in order:
                s = take(b)
                if s is not None:
                    usage[b] -= 1
                    break
            else:
                break    # no victim for this block: it and the blocks after it find no room
            out.append(s)
            usage[asker] += 1
        return out


class _Pins:
    """A tier's reference counts by slot, read through its public `get_block`."""

    def __init__(self, tier: Any) -> None:
        self.get = tier.get_block

    def __getitem__(self, s: int) -> int:
        return self.get(s).ref_cnt


class Tenants:
    """The quotas of a stack's local tiers and the per-tenant counters (YAML `tenants:`)."""

    def __init__(self, cfg: Any, make_eviction: Callable[[str, int], EvictionPolicy]) -> None:
        self.cfg = cfg
        self.key = cfg.tenants.key
        self.kv_field = cfg.tenants.kv_field
        self.labels = cfg.tenants.named() + [OTHER]
        self.index = {n: i for i, n in enumerate(self.labels)}
        self._make = make_eviction
        self.count: Callable[..., None] = _no_count
        self.split: dict[str, TenantEviction] = {}   # tier name -> its split policy
        self._once = Once(log)

    # ---- who ------------------------------------------------------------------------------
    def tenant_of(self, request: Any) -> str | None:
        """A vLLM request's tenant: its cache_salt, or the configured kv_transfer_params field;
        None (counted as `other`) when absent or not a tenant name (`tenants_config.NAME`)."""
        if self.kv_field is None:
            v = getattr(request, "cache_salt", None)
        else:
            p = getattr(request, "kv_transfer_params", None)
            v = p.get(self.kv_field) if isinstance(p, dict) else None
        if v is None or v == "":
            return None
        if not is_name(v):
            self._once(("not a name",), logging.WARNING, "kvtier: a request's tenant (%s) is not a tenant name "
                       "(1-64 of A-Z a-z 0-9 _ . -): counted as %r", self.key, OTHER)
            self.count(Metric.TENANT_NOT_A_NAME.key)
            return None
        return v

    def account(self, tenant: str | None) -> int:
        return self.index.get(tenant, len(self.labels) - 1) if tenant is not None else len(self.labels) - 1

    def label(self, tenant: str | None) -> str:
        return self.labels[self.account(tenant)]

    # ---- tiers ----------------------------------------------------------------------------
    def bind_counter(self, count: Callable[..., None]) -> None:
        """The controller's counter: what the accounts count goes there."""
        self.count = count

    def attach(self, tier: Any, strict: bool = True) -> None:
        """Split `tier`'s eviction policy by account, or, already split, re-derive its quotas from
        its capacity now (the controller calls this on every capacity change); blocks already
        resident (a persistent tier's restored index) are charged to `other`. Sizes that do not
        fit: a ConfigError (`strict`: the configured capacity), else (the tier shrank at run time)
        scaled down, warned once and counted."""
        if tier.shared or not tier.ready:
            return   # a closed persistent tier is attached when it opens (TierController.open_tier)
        cap = tier.capacity_blocks
        q = self._quotas(tier.name, cap, strict)
        if isinstance(tier.eviction, TenantEviction):
            tier.eviction.requota(cap, [q[n] for n in self.labels])
            return
        split = TenantEviction(cap, [self._make(tier.name, cap) for _ in self.labels],
                               [q[n] for n in self.labels], self.labels, tier.name, self._count)
        for k, s in tier.resident.items():
            split.on_insert([s], [k])
        tier.eviction = split
        self.split[tier.name] = split

    def _quotas(self, tier: str, cap: int, strict: bool) -> dict[str, int]:
        try:
            return quota_blocks(self.cfg, tier, cap)
        except ConfigError as e:
            if strict:
                raise
            self._once(("clamped", tier), logging.WARNING, "kvtier: %s: tier %s shrank: the quota sizes are "
                       "scaled down to fit", e, tier)
            self.count(Metric.TENANT_QUOTAS_CLAMPED.at(tier))
            return quota_blocks(self.cfg, tier, cap, clamp=True)

    def _count(self, key: str, v: float = 1) -> None:
        self.count(key, v)

    def of(self, tier: SlotTierContract) -> TenantEviction | None:
        """A local (slot) tier's split policy, None when not split."""
        ev = tier.eviction
        return ev if isinstance(ev, TenantEviction) else None

    def _accounts(self, tenant: str | list[int] | None, n: int) -> list[int]:
        """A tenant (or None) for n blocks, or already each block's account (a list)."""
        return list(tenant) if isinstance(tenant, list) else [self.account(tenant)] * n

    def claim(self, tier: SlotTierContract, slots: Sequence[int], tenant: str | list[int] | None) -> None:
        """Slots just allocated in `tier` will belong to `tenant` (a name or None), or to each
        block's account (a list, as `owners` gives)."""
        ev = self.of(tier)
        if ev is not None:
            for s, a in zip(slots, self._accounts(tenant, len(slots))):
                ev.claimed[s] = a

    def owners(self, tier: SlotTierContract, slots: Sequence[int]) -> list[int]:
        """The account of each of `slots` of `tier` (a pending slot: the one it was claimed for;
        `other` when unknown): what its copies and promotions are charged to."""
        ev = self.of(tier)
        dflt = len(self.labels) - 1
        if ev is None:
            return [dflt] * len(slots)
        return [a if (a := ev.owner[s] if ev.owner[s] >= 0 else ev.claimed[s]) >= 0 else dflt for s in slots]

    def victims(self, tier: SlotTierContract, need: int, tenant: str | list[int] | None, n: int) -> list[int]:
        """Up to `need` slots of `tier` to evict so that `n` blocks of `tenant` (a name or None,
        or each block's account) fit, honouring the quotas: the first blocks take the free slots."""
        ev = self.of(tier)
        if ev is None:
            return tier.free_slots(need)
        acc = self._accounts(tenant, n)
        free = tier.num_free_slots
        return ev.choose(acc[free:free + need], _Pins(tier), acc[:free])

    def count_hits(self, tier: Any, n: int, tenant: str | None) -> None:
        self.count(Metric.TENANT_HIT_BLOCKS.at(tier.name, self.label(tenant)), n)

    # ---- what they hold -------------------------------------------------------------------
    def gauges(self) -> dict[str, int]:
        """gauge_tenant_bytes.<tier>|<tenant>: bytes each account holds in each local tier."""
        out = {}
        for name, ev in self.split.items():
            bb = self.cfg.block_bytes
            for a, lab in enumerate(self.labels):
                out[Metric.TENANT_BYTES.at(name, lab)] = ev.usage[a] * bb
        return out

    def stats(self, totals: dict[str, float] | None = None) -> dict[str, dict]:
        """tenant -> {tier -> {quota_blocks, held_blocks, held_bytes, hits, stored, evicted}}."""
        out: dict[str, dict] = {lab: {} for lab in self.labels}
        for a, lab in enumerate(self.labels):
            for name, ev in self.split.items():
                out[lab][name] = {"quota_blocks": ev.quotas[a], "held_blocks": ev.usage[a],
                                  "held_bytes": ev.usage[a] * self.cfg.block_bytes}
        for lab, per in tenant_counters(totals or {}).items():
            for tier, d in per.items():
                out.setdefault(lab, {}).setdefault(tier, {}).update(d)
        return out


def tenant_counters(totals: dict[str, float]) -> dict[str, dict[str, dict[str, int]]]:
    """tenant -> tier -> {hits, stored, evicted} from counters `tenant_<what>_blocks.<tier>|<tenant>`."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    for key, v in totals.items():
        if not key.startswith("tenant_"):
            continue
        base, _, rest = key.partition(".")
        tier, _, who = rest.rpartition("|")
        if tier and who:
            what = base[len("tenant_"):].removesuffix("_blocks")
            out.setdefault(who, {}).setdefault(tier, {})["hits" if what == "hit" else what] = int(v)
    return out
