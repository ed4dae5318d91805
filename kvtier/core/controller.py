"""TierController: the one control plane. It decides what lives where and never touches bytes.

The vLLM connector's scheduler side, the CLI's stack and trace replay drive it alike: each hands
the plan it takes (`take_plan`) to an executor (`kvtier.core.executor`) and feeds the report back
(`complete`); a block becomes visible only when its bytes are reported written. Decisions, all
here, through the policies and the tiers' cursors: lookup (the longest prefix some tier holds),
leases (`acquire` pins, `load` commits the accepted prefix and plans its loads, `release`),
promotion (a lower-tier hit read through fresh slots of the tier the policy names), store (top
tier, its admission permitting; write-through copies to the next tier at once), eviction and
write-back (victims from the tier's cursor; a dirty victim is copied down first, the cursor's head
cleaned ahead in batches). The shared tier (a tier declaring `shared`; its index is `self.shared`)
is the lowest: the server owns membership and eviction, lookups ask it for what the local tiers
miss, its blocks are never leased (a hit may be gone at load: a handled miss), and it is written
through from the top tier. docs/architecture.md follows one request through it.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Callable, Sequence

from kvtier.common.counters import Metric
from kvtier.common.once import Once
from kvtier.core.ledger import (
    DEFAULT_CAP,
    PENDING,
    CopyInFlight,
    FailedLoads,
    InFlight,
    Lease,
    LeaseTable,
    Pending,
    StoreInFlight,
    rank_sums,
)
from kvtier.core.plan import CopyOp, Counters, LoadOp, Plan, Report, StoreOp
from kvtier.policies.base import NO_INFO, AdmissionPolicy, PromotionPolicy, RequestInfo
from kvtier.tiers.base import group_by_tier, match_prefix
from kvtier.tiers.contract import Tier

log = logging.getLogger("kvtier.core.controller")

DEMOTION = ("write_through", "write_back")


class TierController:
    def __init__(self, tiers: Sequence[Tier], *, block_tokens: int = 1,
                 admission: Sequence[AdmissionPolicy | None] | None = None,
                 promotion: PromotionPolicy | None = None, demotion: str = "write_through",
                 lease_timeout_s: float = 300.0, ranks: int = 1, writeback_blocks: int = 256,
                 tenants: Any = None, failed_loads_cap: int = DEFAULT_CAP, reporters: int | None = None,
                 report_timeout_s: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        """`tiers`: top (fastest) first. `admission[i]`: whether a block is worth writing to
        tier i (None or "all": every block). `promotion`: where a lower-tier hit goes (None:
        served in place). `ranks`: workers that each write a shard of every block (a copy to
        NVMe commits once every rank reported). `writeback_blocks`: the write-back batch.
        `tenants`: per-tenant quotas and counters (`kvtier.core.tenants.Tenants`), or None.
        `failed_loads_cap`: keys whose load failed remembered at most (`kvtier.core.ledger`).
        `reporters`: workers that each copy every store into their own pool (default `ranks`; more
        when the ranks hold the same KV and only the first writes the shard): a store commits once
        every one of them reported it, and is aborted when one has not within `report_timeout_s`
        (default `lease_timeout_s`) on `clock`; copies count the reports of ranks 0..`ranks`-1 only."""
        if demotion not in DEMOTION:
            raise ValueError(f"demotion must be one of {DEMOTION}, got {demotion!r}")
        self.counters = Counters()   # every count of the control plane (and of the tiers, tenants)
        self.tiers: list[Tier] = list(tiers)
        self.names = [t.name for t in self.tiers]
        shared = [i for i, t in enumerate(self.tiers) if t.shared]
        if shared and shared != [len(self.tiers) - 1] or shared == [0]:
            raise ValueError(f"a shared tier must be the lowest of several tiers: {self.names}")
        self.shared: int | None = shared[0] if shared else None   # the shared tier's index, if any
        self.nlocal = len(self.tiers) - len(shared)   # slot tiers, top first
        self.block_tokens = block_tokens
        adm = list(admission or [])
        self.admission: list[AdmissionPolicy | None] = [
            a if a is not None and a.name != "all" else None for a in adm + [None] * (len(self.tiers) - len(adm))]
        self._evict_hooks = [a is not None and type(a).on_evict is not AdmissionPolicy.on_evict
                             for a in self.admission]
        self.promotion = promotion
        self.demotion = demotion
        self.ranks = max(1, int(ranks))
        self.reporters = max(self.ranks, int(reporters or 0))
        self.report_timeout_s = lease_timeout_s if report_timeout_s is None else report_timeout_s
        self.clock = clock
        self.leases = LeaseTable(self._pin, self._unpin, lease_timeout_s, clock)
        for t in self.tiers:  # their own events (network, index writes) join our counters
            t.bind_counter(self.count)
        self.tenants = tenants
        if tenants is not None:
            tenants.bind_counter(self.count)
        self._index = [t.resident for t in self.tiers[:self.nlocal]]  # read-only: key -> slot
        self.inflight = InFlight(len(self.tiers))              # stores and copies awaiting a report
        self._op_ids = itertools.count(1)
        self._plan = Plan()
        self.errors: list[str] = []   # write failures since the caller last cleared it (loud offline)
        self._once = Once(log)
        self.failed = FailedLoads(failed_loads_cap)   # failed loads: not offered until rewritten
        self._wb_max_cfg = writeback_blocks
        self._wb_max = [max(1, min(writeback_blocks, t.capacity_blocks // 4)) for t in self.tiers]
        for t in range(self.nlocal):
            self._settle(t, built=True)
        self._clean = [0] * len(self.tiers)  # victims ahead known clean (write-back), approximately
        # tiers every store is copied to from the top tier: the next (write-through) and the shared tier
        self._through = ([1] if demotion == "write_through" and self.nlocal > 1 else []) + shared

    # ---- counters ------------------------------------------------------------------------
    def count(self, key: str, v: float = 1) -> None:
        """Count into the controller's counters (`key`: a `Metric` key); the drivers and executors
        that count into the controller call this."""
        self.counters.count(key, v)

    @property
    def totals(self) -> dict[str, float]:
        return self.counters.totals

    def total(self, key: str) -> float:
        return self.counters.total(key)

    def take_interval(self) -> dict[str, float] | None:
        return self.counters.take_interval()

    # ---- lookups (no side effects) -------------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> int:
        """Length of the prefix of `keys` present in some tier (the shared tier asked at once)."""
        return len(self.match(keys))

    def match(self, keys: Sequence[bytes], wait: bool = True) -> list[tuple[int, int]] | Pending:
        """(tier, slot) of each block of the present prefix (the topmost copy); a shared-tier
        block's slot is -1. PENDING when `wait` is False and the shared tier is still asked. The
        prefix ends at a block whose load failed (`failed`) until it is rewritten."""
        local = list(zip(*match_prefix(self._index, keys)))
        blocks = local[:self.failed.clean(keys, len(local))]
        if self.shared is not None and len(blocks) == len(local) < len(keys):
            n = self.tiers[self.shared].lookup(keys[len(blocks):], wait)
            if n is None:
                return PENDING
            blocks.extend([(self.shared, -1)] * self.failed.clean(keys[len(blocks):], n))
        return blocks

    def find(self, key: bytes) -> tuple[int, int] | None:
        """(tier, slot) of the topmost local copy of a block, or None (also while its load failed)."""
        if key in self.failed:
            return None
        for t, idx in enumerate(self._index):
            s = idx.get(key)
            if s is not None:
                return t, s
        return None

    def holds(self, key: bytes, tier: int = 0) -> bool:
        """Whether `tier` has the block or is receiving it (the shared tier: as far as known here)."""
        return self.inflight.incoming(tier, key) or self.tiers[tier].holds(key)

    # ---- leases --------------------------------------------------------------------------
    def _pin(self, blocks: Sequence[tuple[int, int]]) -> None:
        """Pin leased blocks of the local tiers (the shared tier's are the server's: never pinned)."""
        for t, slots in group_by_tier(blocks).items():
            if t < self.nlocal:
                self.tiers[t].touch(slots)

    def _unpin(self, blocks: Sequence[tuple[int, int]]) -> None:
        for t, slots in group_by_tier(blocks).items():
            if t < self.nlocal:
                self.tiers[t].free_blocks(slots)

    def acquire(self, request_id: str, keys: Sequence[bytes], start: int = 0,
                wait: bool = True) -> Lease | None | Pending:
        """Pin the present prefix of `keys` (chain positions from `start`) for the request.
        Asking again for the same range pins nothing new; another range replaces the lease.
        `wait=False`: PENDING while the shared tier is being asked (ask again later)."""
        lease = self.leases.get(request_id, start, keys)
        if lease is not None:
            return lease
        blocks = self.match(keys, wait)
        if blocks is PENDING:
            return PENDING
        self.count(Metric.N_LOOKUPS.key)
        if not blocks:
            self.leases.release(request_id)
            return None
        return self.leases.take(request_id, start, keys, blocks)

    def acquire_keys(self, request_id: str, keys: Sequence[bytes]) -> Lease | None:
        """Pin exactly these blocks for the request (a hybrid model's hit: blocks of several groups,
        not one prefix); asking again for the same keys pins nothing new. None, and no lease, when
        a local tier holds not every one."""
        lease = self.leases.get(request_id, -1, keys)
        if lease is not None:
            return lease
        self.count(Metric.N_LOOKUPS.key)
        blocks = [self.find(k) for k in keys]
        if not keys or any(b is None for b in blocks):
            self.leases.release(request_id)
            return None
        return self.leases.take(request_id, -1, keys, blocks)

    def leased(self, request_id: str) -> int:
        return self.leases.held(request_id)

    def take_errors(self) -> list[str]:
        """Write failures since the last call, once (the CLI's exit status)."""
        out, self.errors = self.errors, []
        return out

    def release(self, request_id: str) -> int:
        n = self.leases.release(request_id)
        if n:
            self.count(Metric.LEASES_RELEASED.key)
        return n

    def expire(self) -> dict[int, list[bool]]:
        """Release the leases past their deadline, abort the stores some rank never reported in
        time; returns those stores (op id -> per block False), finished now."""
        self.leases.expire()
        now = self.clock()
        out: dict[int, list[bool]] = {}
        for op_id in self.inflight.overdue_stores(now):
            st = self.inflight.take_store(op_id)
            missing = sorted(set(range(self.reporters)) - set(st.reports))
            name = self.names[st.tier]
            self.count(Metric.STORE_UNREPORTED_BLOCKS.at(name), len(st.slots))
            self._once(("store_unreported", st.tier), logging.ERROR,
                       "kvtier: a store of %d blocks to %s was not reported by ranks %s within %.0f s: aborted "
                       "(counted in store_unreported_blocks; later ones not logged)", len(st.slots), name, missing,
                       self.report_timeout_s)
            out[op_id] = [False] * len(st.slots)
            self._finish_store(st, out[op_id], [])
        return out

    def _report_by(self) -> float:
        """The deadline of a store planned now: every rank reported it by then, or it is aborted."""
        return self.clock() + self.report_timeout_s

    # ---- loads ---------------------------------------------------------------------------
    def load(self, request_id: str, num_blocks: int, dsts: Sequence[int], info: RequestInfo = NO_INFO,
             checksums: bool = True, tokens: int | None = None) -> list[LoadOp]:
        """Commit the request's lease to its first `num_blocks` blocks and plan their loads into
        `dsts` (caller's block ids: vLLM's GPU blocks or buffer indices). Records the hits with
        the eviction policies and plans promotions. Returns the load ops (also in the plan).
        `tokens`: the hit's tokens (default: its blocks' tokens; a hybrid hit loads blocks of
        several groups for the same tokens)."""
        lease = self.leases.commit(request_id, num_blocks)
        if lease is None:
            return []
        ops: dict[int, LoadOp] = {}
        keys_of: dict[int, list[bytes]] = {}
        pos_of: dict[int, list[int]] = {}
        for j, ((t, s), b, k) in enumerate(zip(lease.blocks, dsts, lease.keys)):
            op = ops.get(t)
            if op is None:
                op = ops[t] = LoadOp(request_id, t, [], [])
                keys_of[t] = []
                pos_of[t] = []
            op.slots.append(s)
            op.block_ids.append(b)
            keys_of[t].append(k)
            pos_of[t].append(lease.start + j)
        for t, op in ops.items():
            tier = self.tiers[t]
            op.checksums, op.keys = tier.prepare_load(op.slots, keys_of[t], checksums, info)
            n = len(op.slots)
            self.count(Metric.HIT_BLOCKS.at(tier.name), n)
            self.count(Metric.HIT_TOKENS.at(tier.name), n * self.block_tokens)
            if self.tenants is not None:
                self.tenants.count_hits(tier, n, info.tenant)
            if t > 0:
                self._plan_promotion(op, keys_of[t], info, pos_of[t])
        self.count(Metric.HIT_TOKENS.key, lease.num_blocks * self.block_tokens if tokens is None else tokens)
        self.count(Metric.N_LOADS.key)
        out = list(ops.values())
        self._plan.loads.extend(out)
        return out

    def _plan_promotion(self, op: LoadOp, keys: list[bytes], info: RequestInfo, pos: list[int]) -> None:
        """Read a lower-tier load through fresh slots of the promotion target (all or none)."""
        if self.promotion is None:
            return
        tgt = self.promotion.target(op.tier, len(self.tiers))
        if tgt is None or tgt >= op.tier:
            return
        src = self.tiers[op.tier]   # the server's blocks have no owner here: the requester is charged
        who = info.tenant if src.shared or self.tenants is None else self.tenants.owners(src, op.slots)
        if any(self.holds(k, tgt) for k in keys) or self._room(tgt, len(keys), who) < len(keys):
            return
        slots = self.tiers[tgt].allocate(keys, info)
        self._claim(tgt, slots, who)
        op.via = slots
        op.via_tier = tgt
        op.op_id = next(self._op_ids)
        # exclusive: the lower copy leaves once read up (never the server's: it is the fleet's)
        excl = None if self.promotion.inclusive or src.shared else (op.tier, list(zip(op.slots, keys)))
        self.inflight.add_store(op.op_id, StoreInFlight(tgt, slots, list(keys), promotion=True, exclusive_from=excl,
                                                        info=info, pos=pos, deadline=self._report_by()))

    # ---- stores --------------------------------------------------------------------------
    def store(self, keys: Sequence[bytes], srcs: Sequence[int], info: RequestInfo = NO_INFO,
              admit: bool = True, retry: bool = False) -> tuple[list[int], int, list[int]]:
        """Plan storing blocks (caller's block ids `srcs`) into the top tier; blocks the top tier
        holds or is receiving are skipped. Returns (indices of the blocks planned, the store op
        id or 0, indices admitted that found no room now: counted as dropped unless the caller
        will `retry` them). A block whose top-tier copy failed to load is stored afresh."""
        top = self.tiers[0]
        stale = [s for k in keys if k in self.failed and (s := top.find(k)) is not None
                 and not top.get_block(s).ref_cnt]
        if stale:  # a top-tier copy whose load failed: replaced by this fresh one
            self._evict(0, stale)
        want = [i for i, k in enumerate(keys) if not self.holds(k, 0)]
        if want and admit:
            want = self._admit(0, want, [keys[i] for i in want], info)
        if not want:
            return [], 0, []
        room = self._room(0, len(want), info.tenant)
        deferred = want[room:]
        if deferred:
            if not retry:
                self.count_dropped(0, len(deferred))
            want = want[:room]
        if not want:
            return [], 0, deferred
        ks = [keys[i] for i in want]
        slots = top.allocate(ks, info)
        self._claim(0, slots, info.tenant)
        op_id = next(self._op_ids)
        self.inflight.add_store(op_id, StoreInFlight(0, slots, ks, info=info, pos=[info.start + i for i in want],
                                                     deadline=self._report_by()))
        self._plan.stores.append(StoreOp(op_id, 0, slots, [srcs[i] for i in want], ks if top.verifies else []))
        self.count(Metric.STORE_PLANNED_BLOCKS.at(top.name), len(slots))
        for t in self._through:  # written through from the top tier
            lower = [j for j, k in enumerate(ks) if not self.holds(k, t)]
            lower = self._admit(t, lower, [ks[j] for j in lower], info)
            self._plan_copy(0, [(slots[j], ks[j]) for j in lower], t)
        return want, op_id, deferred

    def count_dropped(self, t: int, n: int) -> None:
        """`n` blocks found no room in tier `t` (every slot pinned or being copied down)."""
        self.count(Metric.STORE_DROPPED_BLOCKS.at(self.names[t]), n)

    def _admit(self, t: int, items: list, keys: Sequence[bytes], info: RequestInfo = NO_INFO) -> list:
        pol = self.admission[t]
        if pol is None or not items:
            return items
        ok = pol.admit(keys, info)
        out = [x for x, a in zip(items, ok) if a]
        if len(out) < len(items):
            self.count(Metric.NOT_ADMITTED_BLOCKS.at(self.names[t]), len(items) - len(out))
        return out

    def _plan_copy(self, src_tier: int, src: list[tuple[int, bytes]], t: int | None = None) -> int:
        """Copy (slot, key) blocks of `src_tier` into new slots of tier `t` (default: the next; the
        shared tier gives no slots and is never short of room: the server evicts); the sources
        stay pinned until the copy is reported durable. Returns how many."""
        t = src_tier + 1 if t is None else t
        if not src:
            return 0
        if not self.tiers[t].ready:   # a persistent tier waiting for the model's identity
            self.count(Metric.NOT_OPEN_BLOCKS.at(self.names[t]), len(src))
            return 0
        keys = [k for _, k in src]
        if self.tiers[t].shared:   # nothing to reserve: the server names the blocks by key and evicts
            slots: list[int] = []
        else:
            who = self.tenants.owners(self.tiers[src_tier], [s for s, _ in src]) if self.tenants is not None else None
            room = self._room(t, len(src), who)
            if room < len(src):
                self.count(Metric.STORE_DROPPED_BLOCKS.at(self.names[t]), len(src) - room)
                src, keys = src[:room], keys[:room]
            if not src:
                return 0
            slots = self.tiers[t].allocate(keys)
            self._claim(t, slots, who[:room] if who is not None else None)
        self.tiers[src_tier].touch([s for s, _ in src])
        op_id = next(self._op_ids)
        self.inflight.add_copy(op_id, CopyInFlight(src_tier, src, t, slots))
        self._plan.copies.append(CopyOp(op_id, [s for s, _ in src], slots, src_tier=src_tier, tier=t, keys=keys))
        self.count(Metric.STORE_PLANNED_BLOCKS.at(self.names[t]), len(src))
        return len(src)

    # ---- room: eviction and write-back ---------------------------------------------------
    def _claim(self, t: int, slots: Sequence[int], tenant: Any) -> None:
        if self.tenants is not None:
            self.tenants.claim(self.tiers[t], slots, tenant)

    def _victims(self, t: int, need: int, tenant: Any, n: int) -> list[int]:
        """Up to `need` victims of tier `t` in its policy's order (with tenants: honouring the
        quotas, for `n` blocks of `tenant`: a name, or each block's account)."""
        if self.tenants is None:
            return self.tiers[t].free_slots(need)
        return self.tenants.victims(self.tiers[t], need, tenant, n)

    def _room(self, t: int, n: int, tenant: Any = None) -> int:
        """Evict from tier `t` until `n` slots are free (or nothing more can go now); free slots.

        Write-back: a victim the next tier lacks (dirty) is copied down and stays, pinned, until
        the copy is durable; clean blocks further down the cursor go instead. A dirty block never
        leaves in the plan that copies it (its slot is not reused before its bytes are read);
        `take_plan` cleans ahead so that victims are mostly clean when they are needed."""
        tier = self.tiers[t]
        need = n - tier.num_free_slots
        if need <= 0:
            return tier.num_free_slots
        if self.demotion != "write_back" or t + 1 >= self.nlocal:
            victims = self._victims(t, need, tenant, n)
            if victims:
                self._evict(t, victims)
            return tier.num_free_slots
        while need > 0:
            ahead = self._victims(t, need, tenant, n)
            if not ahead:
                break
            if not all(self.holds(tier.key_at(s), t + 1) for s in ahead):
                # not cleaned ahead in time: copy the dirty blocks of a window down now (they
                # leave in a later plan); the clean ones go now, and what the next tier refused
                self._clean_ahead(t, need)
                clean = [s for s in ahead if tier.get_block(s).ref_cnt == 0]
            else:
                clean = ahead
            if clean:
                self._evict(t, clean)
            need -= len(clean)
        return tier.num_free_slots

    def _write_back(self, t: int, dirty: list[tuple[int, bytes]]) -> None:
        if self.admission[t + 1] is not None:
            dirty = self._admit(t + 1, dirty, [k for _, k in dirty])
        self._plan_copy(t, dirty)

    def _clean_ahead(self, t: int, need: int = 0) -> None:
        """Write-back: copy the dirty blocks among the next `window` victims of tier `t` down in
        one batch (they stay, pinned while the copy runs, and later leave without I/O), so that
        the next plans find clean victims. Runs when fewer than half a window of the victims
        ahead is known clean, so the walk costs about one step per block that leaves."""
        tier = self.tiers[t]
        ahead = tier.free_slots(max(need, self._wb_max[t]))
        dirty = [(s, k) for s in ahead if not self.holds(k := tier.key_at(s), t + 1)]
        if dirty:
            self._write_back(t, dirty)
        self._clean[t] = len(ahead)

    def _evict(self, t: int, slots: Sequence[int]) -> None:
        gone = self.tiers[t].evict(slots)
        self._clean[t] -= len(gone)
        self.count(Metric.EVICTED_BLOCKS.at(self.names[t]), len(gone))
        if self._evict_hooks[t]:
            on_evict = self.admission[t].on_evict
            for k in gone:
                on_evict(k)

    def flush(self, t: int = 0, batch: int = 256) -> int:
        """Plan copying every resident block of tier `t` that the next (slot) tier lacks; returns
        how many. The shared tier is written through at store time instead."""
        if t + 1 >= self.nlocal:
            return 0
        tier = self.tiers[t]
        todo = [(s, k) for k, s in list(tier.resident.items()) if not self.holds(k, t + 1)]
        n = 0
        for i in range(0, len(todo), batch):
            n += self._plan_copy(t, todo[i:i + batch])
        return n

    # ---- the plan and its completion -----------------------------------------------------
    def count_request(self, asked_blocks: int, hit_blocks: int) -> None:
        """A request's outcome: of `asked_blocks` looked up, `hit_blocks` were served."""
        miss = max(0, asked_blocks - hit_blocks)
        self.count(Metric.MISS_BLOCKS.key, miss)
        self.count(Metric.MISS_TOKENS.key, miss * self.block_tokens)

    def has_plan(self) -> bool:
        return not self._plan.is_empty()

    def take_plan(self) -> Plan:
        """The ops decided since the last call (write-back tiers clean ahead first)."""
        if self.demotion == "write_back":
            for t in range(self.nlocal - 1):
                if 2 * self._clean[t] < self._wb_max[t] and self.tiers[t].num_free_slots < self._wb_max[t]:
                    self._clean_ahead(t)
        p, self._plan = self._plan, Plan()
        return p

    # ---- whole-stack operations ----------------------------------------------------------
    def clear(self, fresh_eviction: Sequence[Any] | None = None) -> int:
        """Drop every resident block of every tier; nothing may be leased or in flight."""
        if len(self.leases) or len(self.inflight):
            raise RuntimeError("clear with leases or transfers in flight")
        n = 0
        for i, t in enumerate(self.tiers[:self.nlocal]):  # never the shared tier: it is the fleet's
            slots = list(t.resident.values())
            if slots:
                t.evict(slots)
                n += len(slots)
            if fresh_eviction is not None:
                t.eviction = fresh_eviction[i]
                self._settle(i)
        return n

    def _limit(self, t: int, n: int) -> None:
        """Tier `t`'s data plane holds `n` slots: the tier shrinks to them (a report's `capacity`)."""
        tier = self.tiers[t]
        if n >= tier.capacity_blocks:
            return
        was = tier.capacity_blocks
        gone = tier.limit(n)
        self._settle(t)
        if gone:
            self.count(Metric.EVICTED_BLOCKS.at(tier.name), len(gone))
        log.warning("kvtier: tier %s holds %d blocks, not the %d configured: its data plane (the workers' "
                    "pool) is smaller", tier.name, n, was)

    def _settle(self, t: int, built: bool = False) -> None:
        """Local tier `t`'s capacity or policy is set or changed (`built`: at its configured
        capacity, when built or opened; else cleared or shrunk): every such change comes here, and
        the write-back batch and the tenants' quotas follow it."""
        self._wb_max[t] = max(1, min(self._wb_max_cfg, self.tiers[t].capacity_blocks // 4))
        if self.tenants is not None:
            self.tenants.attach(self.tiers[t], strict=built)

    def open_tier(self, t: int, tier: Tier) -> None:
        """Put `tier` in place of the closed tier at index `t` (`tiers.closed.ClosedTier`: a
        persistent tier opened once the model's identity is known)."""
        old = self.tiers[t]
        if old.ready or tier.shared != old.shared:
            raise ValueError(f"tier {t} ({old.name}) is not a closed tier of that kind")
        self.tiers[t] = tier
        self.names[t] = tier.name
        tier.bind_counter(self.count)
        if t < self.nlocal:
            self._index[t] = tier.resident
            self._settle(t, built=True)
        old.close()

    # ---- the executor's report ----------------------------------------------------------------
    # what is in flight is asked and changed through `InFlight`'s methods (`self.inflight`) only
    def complete(self, rep: Report) -> dict[int, list[bool]]:
        """The executor's report: commit what was written, abort what failed, drop what did not
        verify, release the leases of loads that finished. A store finishes once every rank
        (`reporters`) reported it, in this report or earlier ones (each rank's failure fails its
        blocks); returns the stores finished now: op id -> per block committed."""
        for t, n in rep.capacity.items():  # a data plane smaller than configured: before its results
            self._limit(t, n)
        exclusive: list[tuple[int, list[tuple[int, bytes]]]] = []
        done: dict[int, list[bool]] = {}
        for op_id, by_rank in sorted(rep.stored_by_rank().items()):  # plan order, whatever order the report has
            st = self.inflight.store_of(op_id)
            if st is None:
                continue
            oks = st.reported(by_rank, self.reporters, rep.store_tags.get(op_id))   # once every rank reported
            if oks is None:
                continue
            self.inflight.take_store(op_id)
            done[op_id] = oks
            self._finish_store(st, oks, exclusive)
        self._remember_failed(rep)   # before a bad block's tier quarantines it (its key then gone)
        for t, slots in rep.corrupt.items():  # failed verification on read: a miss from now on
            tier = self.tiers[t]
            tier.complete_load(bad=slots)
            self.count(Metric.CORRUPT_BLOCKS.at(tier.name), len(slots))
        for op_id, by_rank in sorted(rep.written_by_rank().items()):
            self._complete_copy(op_id, by_rank)
        if (rep.gone or rep.bad) and self.shared is not None:
            # found by lookup, gone (or bad) at load: a miss; failed verification: remembered, the
            # next lookup misses
            self.tiers[self.shared].complete_load(bad=rep.bad, gone=rep.gone)
            if rep.gone:
                self.count(Metric.GONE_BLOCKS.at(self.names[self.shared]), len(rep.gone))
            if rep.bad:
                self.count(Metric.BAD_BLOCKS.at(self.names[self.shared]), len(rep.bad))
        for rid, ok in rep.loaded.items():
            self.release(rid)
            if not ok:
                self.count(Metric.LOAD_FAILED_REQUESTS.key)
        for lower, src in exclusive:  # exclusive promotion: the lower (local) copy leaves once read up
            tier = self.tiers[lower]
            gone = [s for s, k in src if tier.find(k) == s and tier.get_block(s).ref_cnt == 0]
            if gone:
                self._evict(lower, gone)
        return done

    def _finish_store(self, st: StoreInFlight, oks: list[bool], exclusive: list) -> None:
        """Every rank reported store `st` (`oks`: per block, stored by all): commit what was, abort
        the rest; an exclusive promotion's lower copies to drop go to `exclusive`."""
        tier = self.tiers[st.tier]
        sums = st.sums(self.ranks)   # a store into a file: its blocks' tags (written and flushed)
        if sums is not None:
            oks = [ok and c != -1 for ok, c in zip(oks, sums)]
        good = [j for j, ok in enumerate(oks[:len(st.slots)]) if ok]
        bad = [s for s, ok in zip(st.slots, oks) if not ok] + list(st.slots[len(oks):])
        if good:
            try:
                st.commit(tier, good, sums)
            except OSError as e:  # a file's index write failed: nothing of it indexed, the slots aborted
                self._once(("commit", st.tier, e.errno), logging.ERROR, "kvtier: tier %s: commit of %d stored "
                           "blocks failed: %s (counted in store_failed_blocks)", tier.name, len(good), e)
                bad, good = bad + [st.slots[j] for j in good], []
        if good:
            self.failed.forget(st.keys[j] for j in good)
            self.count(Metric.STORED_BLOCKS.at(tier.name), len(good))
            if st.promotion:
                self.count(Metric.PROMOTED_BLOCKS.at(tier.name), len(good))
                if st.exclusive_from is not None:
                    lower, src = st.exclusive_from
                    ok_keys = {k for s, k, ok in zip(st.slots, st.keys, oks) if ok}
                    exclusive.append((lower, [(s, k) for s, k in src if k in ok_keys]))
        if bad and st.promotion:  # its read failed (a miss, counted with the read): nothing to promote
            tier.abort(bad)
        elif bad:
            tier.abort(bad)
            self.count(Metric.STORE_FAILED_BLOCKS.at(tier.name), len(bad))
            self.errors.append(f"tier {tier.name}: {len(bad)} of {len(st.slots)} block writes failed")
        self.inflight.landed(st.tier, st.keys)

    def _remember_failed(self, rep: Report) -> None:
        """Blocks whose load failed, for any reason: remembered, so no lookup offers them again
        until a fresh copy is written (`kvtier.core.ledger`)."""
        for t, blocks in rep.unread.items():
            tier = self.tiers[t]
            keys = list(blocks) if tier.shared else [k for s in blocks if (k := tier.key_at(s)) is not None]
            new, forgotten = self.failed.add(keys)
            if new:
                self.count(Metric.FAILED_LOAD_BLOCKS.at(tier.name), new)
                self._once(("failed_load", tier.name), logging.WARNING, "kvtier: %d blocks of tier %s failed to "
                           "load: not offered again until rewritten (at most %d remembered; later ones counted in "
                           "failed_load_blocks)", new, tier.name, self.failed.cap)
            if forgotten:
                self.count(Metric.FAILED_LOADS_FORGOTTEN.key, forgotten)
                self._once(("failed_load_cap",), logging.WARNING, "kvtier: more than %d failed loads remembered: "
                           "the oldest are forgotten (may be offered once more; counted in failed_loads_forgotten)",
                           self.failed.cap)

    def _complete_copy(self, op_id: int, by_rank: dict[int, list]) -> None:
        cp = self.inflight.copy_of(op_id)
        if cp is None:
            return
        if self.reporters > self.ranks:  # the ranks hold the same KV: only ranks 0..ranks-1 write the shard
            by_rank = {r: v for r, v in by_rank.items() if r < self.ranks}
            if not by_rank:
                return
        by_rank = cp.reported(by_rank, self.ranks)   # several ranks: once every rank reported
        if by_rank is None:
            return
        self.inflight.take_copy(op_id)
        tier, src_tier = self.tiers[cp.tier], self.tiers[cp.src_tier]
        sums = rank_sums(by_rank, len(cp.src), self.ranks)
        if tier.shared:  # the server names the blocks: known now, nothing to commit
            self._complete_put(cp, sums)
            return
        good = [s for s, c in zip(cp.slots, sums) if c != -1]
        bad = [s for s, c in zip(cp.slots, sums) if c == -1]
        try:
            tier.complete_store(cp.slots, [k for _, k in cp.src], sums)  # durable: now its index
        except OSError as e:  # e.g. fdatasync failed: nothing indexed, the source copy stays
            self._once(("commit", cp.tier, e.errno), logging.ERROR,
                       "kvtier: tier %s: commit of %d blocks failed, kept in %s: %s (counted in "
                       "store_failed_blocks; later failures of this kind at DEBUG)", tier.name, len(good),
                       src_tier.name, e)
            self.errors.append(f"tier {tier.name}: {e}")
            bad = good + bad
            tier.abort(bad)
        else:
            if good:
                self.count(Metric.STORED_BLOCKS.at(tier.name), len(good))
                self.count(Metric.DEMOTED_BLOCKS.at(tier.name), len(good))
                self.failed.forget(k for (_, k), c in zip(cp.src, sums) if c != -1)
        if bad:
            self.count(Metric.STORE_FAILED_BLOCKS.at(tier.name), len(bad))
            self.count(Metric.IO_ERRORS.at(tier.name), len(bad))
            self.errors.append(f"tier {tier.name}: {len(bad)} of {len(cp.slots)} block writes failed "
                               f"(kept in {src_tier.name}, not indexed)")
        self.inflight.landed(cp.tier, [k for _, k in cp.src])
        for s, k in cp.src:  # unpin the sources that still hold the same block
            src_tier.unpin_if(s, k)

    def _complete_put(self, cp: CopyInFlight, sums: list) -> None:
        tier, src_tier = self.tiers[cp.tier], self.tiers[cp.src_tier]
        tier.complete_store(cp.slots, [k for _, k in cp.src], sums)   # no slots: by key
        good = [k for (_, k), c in zip(cp.src, sums) if c != -1]
        if good:
            self.failed.forget(good)
            self.count(Metric.STORED_BLOCKS.at(tier.name), len(good))
        if len(good) < len(cp.src):  # the server refused or was unreachable: counted, not retried
            self.count(Metric.STORE_FAILED_BLOCKS.at(tier.name), len(cp.src) - len(good))
        self.inflight.landed(cp.tier, [k for _, k in cp.src])
        for s, k in cp.src:
            src_tier.unpin_if(s, k)

    @property
    def in_flight(self) -> int:
        return len(self.inflight)

    def pinned_blocks(self) -> int:
        return sum(t.pinned_blocks() for t in self.tiers[:self.nlocal])

    def describe(self) -> dict:
        return {"eviction": [t.eviction_name for t in self.tiers],
                "admission": [a.name if a is not None else "all" for a in self.admission],
                "promotion": self.promotion.name if self.promotion is not None else "none",
                "demotion": self.demotion}

    def stats(self) -> dict:
        return {"totals": dict(self.totals), "tiers": [t.stats() for t in self.tiers],
                **({"tenants": self.tenants.stats(self.totals)} if self.tenants is not None else {}),
                "policies": self.describe(), "leases": self.leases.pinned(),
                "pending_stores": self.inflight.stores, "pending_copies": self.inflight.copies}

    def close(self) -> None:
        pending = self.inflight.copying_blocks()
        if pending:
            log.warning("kvtier: %d blocks still being copied down at shutdown: not committed (misses after a "
                        "restart, never served)", pending)
            self.count(Metric.UNCOMMITTED_AT_CLOSE.key, pending)
        self.leases.expire(float("inf"))
        for t in reversed(self.tiers):  # lower tiers first: their in-flight I/O may read an upper pool
            t.close()
