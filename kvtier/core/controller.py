"""TierController: the one control plane. It decides what lives where and never touches bytes.

Used alike by the vLLM connector's scheduler side (`kvtier.connector.scheduler`), the offline
stack (`kvtier.core.stack`: CLI spill / restore / bench) and trace replay (`kvtier.offline.replay`).
Each caller hands the plan it takes (`take_plan`) to an executor that moves the bytes (the
connector's workers, `kvtier.core.executor.LocalExecutor`, or `NullExecutor` for replay without
data) and feeds the executor's report back through `complete`.

Decisions, all here:
- lookup: the longest prefix of keys held by some tier (topmost copy); side-effect free;
- lease: `acquire` pins the matched blocks (idempotent per request and range), `load` commits
  the accepted prefix and plans its loads, `release` unpins;
- promotion: a block loaded from a lower tier is read through fresh slots of the tier the
  promotion policy names (inclusive: the lower copy stays; exclusive: it is evicted once read);
- store: new blocks go to the top tier when its admission policy admits them; under
  write-through they are copied to the next tier at once (its admission permitting);
- eviction / demotion: victims come from the tier's cursor; under write-back a victim the next
  tier lacks is copied down first (kept, pinned, until the copy is durable), and the head of the
  cursor is cleaned ahead in batches so that victims are mostly clean when they are needed.
A block becomes visible only when the executor reports its bytes written (`complete`).

A shared tier (`kvtier.tiers.redis`, `remote = True`) may be the lowest tier. The server owns its
membership and eviction: lookups ask it (`probe`) for the part of the prefix the local tiers
miss, its blocks are never leased (a hit may be gone at load: a handled miss), it is written
through from the top tier whatever `demotion` says (a fleet shares a prefix once computed), its
admission policy permitting, and it is never cleared or evicted from here.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from kvtier.core.leases import Lease, LeaseTable
from kvtier.core.once import Once
from kvtier.policies.base import NO_INFO, AdmissionPolicy, PromotionPolicy, RequestInfo
from kvtier.tiers.base import SlotTier, group_by_tier, match_prefix

from kvtier.core.plan import Counting, LoadOp, CopyOp, Plan, Report, StoreOp

log = logging.getLogger("kvtier.core.controller")

DEMOTION = ("write_through", "write_back")


class _Pending:
    def __repr__(self) -> str:
        return "PENDING"


PENDING = _Pending()   # acquire(wait=False): the shared tier's answer is on its way; ask again


@dataclass
class _Copy:
    """A tier-to-tier copy in flight: sources stay pinned until the target is durable."""

    src_tier: int
    src: list[tuple[int, bytes]]      # (slot, key) in the source tier
    tier: int
    slots: list[int]                  # in the target tier (none for the shared tier)
    reports: dict[int, list] = field(default_factory=dict)  # rank -> checksums (several ranks)


@dataclass
class _Store:
    tier: int
    slots: list[int]
    keys: list[bytes]
    promotion: bool = False
    exclusive_from: tuple[int, list[tuple[int, bytes]]] | None = None  # (lower tier, its copies)
    info: RequestInfo = field(default_factory=lambda: NO_INFO)
    pos: list[int] | None = None      # chain position of each slot (the policies' insert order)

    def commit(self, tier: SlotTier, good: list[int]) -> None:
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


class TierController(Counting):
    def __init__(self, tiers: Sequence[SlotTier], *, block_tokens: int = 1,
                 admission: Sequence[AdmissionPolicy | None] | None = None,
                 promotion: PromotionPolicy | None = None, demotion: str = "write_through",
                 lease_timeout_s: float = 300.0, ranks: int = 1, writeback_blocks: int = 256) -> None:
        """`tiers`: top (fastest) first. `admission[i]`: whether a block is worth writing to
        tier i (None or "all": every block). `promotion`: where a lower-tier hit goes (None:
        served in place). `ranks`: workers that each write a shard of every block (a copy to
        NVMe commits once every rank reported). `writeback_blocks`: the write-back batch."""
        if demotion not in DEMOTION:
            raise ValueError(f"demotion must be one of {DEMOTION}, got {demotion!r}")
        self._init_counters()
        self.tiers = list(tiers)
        self.names = [t.name for t in self.tiers]
        remote = [i for i, t in enumerate(self.tiers) if t.remote]
        if remote and remote != [len(self.tiers) - 1] or remote == [0]:
            raise ValueError(f"a shared tier must be the lowest of several tiers: {self.names}")
        self.remote: int | None = remote[0] if remote else None
        self.nlocal = len(self.tiers) - len(remote)   # slot tiers, top first
        self.block_tokens = block_tokens
        adm = list(admission or [])
        self.admission: list[AdmissionPolicy | None] = [
            a if a is not None and a.name != "all" else None for a in adm + [None] * (len(self.tiers) - len(adm))]
        self._evict_hooks = [a is not None and type(a).on_evict is not AdmissionPolicy.on_evict
                             for a in self.admission]
        self.promotion = promotion
        self.demotion = demotion
        self.ranks = max(1, int(ranks))
        self.leases = LeaseTable(self._pin, self._unpin, lease_timeout_s)
        for t in self.tiers:  # their own events (network, index writes) join our counters
            t.bind_counter(self._count)
        self._index = [t.resident for t in self.tiers[:self.nlocal]]  # read-only: key -> slot
        self._pending = [set() for _ in self.tiers]            # keys on their way into each tier
        self._stores: dict[int, _Store] = {}
        self._copies: dict[int, _Copy] = {}
        self._op_ids = itertools.count(1)
        self._plan = Plan()
        self.errors: list[str] = []   # write failures since the caller last cleared it (loud offline)
        self._once = Once(log)
        self._wb_max = [max(1, min(writeback_blocks, t.capacity_blocks // 4)) for t in self.tiers[:self.nlocal]]
        self._clean = [0] * len(self.tiers)  # victims ahead known clean (write-back), approximately

    # ---- lookups (no side effects) -------------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> int:
        """Length of the prefix of `keys` present in some tier (the shared tier asked at once)."""
        return len(self.match(keys))

    def match(self, keys: Sequence[bytes], wait: bool = True) -> list[tuple[int, int]] | _Pending:
        """(tier, slot) of each block of the present prefix (the topmost copy); a shared-tier
        block's slot is -1. PENDING when `wait` is False and the shared tier is still asked."""
        blocks = list(zip(*match_prefix(self._index, keys)))
        if self.remote is not None and len(blocks) < len(keys):
            n = self.tiers[self.remote].probe(keys[len(blocks):], wait)
            if n is None:
                return PENDING
            blocks.extend([(self.remote, -1)] * n)
        return blocks

    def holds(self, key: bytes, tier: int = 0) -> bool:
        """Whether `tier` has the block or is receiving it (the shared tier: as far as known here)."""
        if tier == self.remote:
            return key in self._pending[tier] or self.tiers[tier].known(key)
        return key in self._index[tier] or key in self._pending[tier]

    # ---- leases --------------------------------------------------------------------------
    def _pin(self, blocks: Sequence[tuple[int, int]]) -> None:
        for t, slots in group_by_tier(blocks).items():
            if t != self.remote:   # the server owns its blocks: nothing to pin
                self.tiers[t].touch(slots)

    def _unpin(self, blocks: Sequence[tuple[int, int]]) -> None:
        for t, slots in group_by_tier(blocks).items():
            if t != self.remote:
                self.tiers[t].free_blocks(slots)

    def acquire(self, request_id: str, keys: Sequence[bytes], start: int = 0,
                wait: bool = True) -> Lease | None | _Pending:
        """Pin the present prefix of `keys` (chain positions from `start`) for the request.
        Asking again for the same range pins nothing new; another range replaces the lease.
        `wait=False`: PENDING while the shared tier is being asked (ask again later)."""
        lease = self.leases.get(request_id, start, keys)
        if lease is not None:
            return lease
        blocks = self.match(keys, wait)
        if blocks is PENDING:
            return PENDING
        self._count("n_lookups")
        if not blocks:
            self.leases.release(request_id)
            return None
        return self.leases.take(request_id, start, keys, blocks)

    def release(self, request_id: str) -> int:
        n = self.leases.release(request_id)
        if n:
            self._count("leases_released")
        return n

    def expire(self) -> None:
        self.leases.expire()

    # ---- loads ---------------------------------------------------------------------------
    def load(self, request_id: str, num_blocks: int, dsts: Sequence[int], info: RequestInfo = NO_INFO,
             checksums: bool = True) -> list[LoadOp]:
        """Commit the request's lease to its first `num_blocks` blocks and plan their loads into
        `dsts` (caller's block ids: vLLM's GPU blocks or buffer indices). Records the hits with
        the eviction policies and plans promotions. Returns the load ops (also in the plan)."""
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
            if t == self.remote:
                op.keys = keys_of[t]
                tier.touch_keys(op.keys)
            elif checksums and tier.verifies:
                op.checksums = tier.checksums(op.slots)
                op.keys = keys_of[t]
            tier.hit(op.slots, info)
            n = len(op.slots)
            self._count(f"hit_blocks.{tier.name}", n)
            self._count(f"hit_tokens.{tier.name}", n * self.block_tokens)
            if t > 0:
                self._plan_promotion(op, keys_of[t], info, pos_of[t])
        self._count("hit_tokens", lease.num_blocks * self.block_tokens)
        self._count("n_loads")
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
        if any(self.holds(k, tgt) for k in keys) or self._room(tgt, len(keys)) < len(keys):
            return
        slots = self.tiers[tgt].allocate(keys, info)
        self._pending[tgt].update(keys)
        op.via = slots
        op.via_tier = tgt
        op.op_id = next(self._op_ids)
        excl = None if self.promotion.inclusive or op.tier == self.remote else (op.tier, list(zip(op.slots, keys)))
        self._stores[op.op_id] = _Store(tgt, slots, list(keys), promotion=True, exclusive_from=excl,
                                        info=info, pos=pos)

    # ---- stores --------------------------------------------------------------------------
    def store(self, keys: Sequence[bytes], srcs: Sequence[int], info: RequestInfo = NO_INFO,
              admit: bool = True, retry: bool = False) -> tuple[list[int], int, list[int]]:
        """Plan storing blocks (caller's block ids `srcs`) into the top tier; blocks the top tier
        holds or is receiving are skipped. Returns (indices of the blocks planned, the store op
        id or 0, indices admitted that found no room now: counted as dropped unless the caller
        will `retry` them)."""
        top = self.tiers[0]
        want = [i for i, k in enumerate(keys) if not self.holds(k, 0)]
        if want and admit:
            want = self._admit(0, want, [keys[i] for i in want], info)
        if not want:
            return [], 0, []
        room = self._room(0, len(want))
        deferred = want[room:]
        if deferred:
            if not retry:
                self.count_dropped(0, len(deferred))
            want = want[:room]
        if not want:
            return [], 0, deferred
        ks = [keys[i] for i in want]
        slots = top.allocate(ks, info)
        self._pending[0].update(ks)
        op_id = next(self._op_ids)
        self._stores[op_id] = _Store(0, slots, ks, info=info, pos=[info.start + i for i in want])
        self._plan.stores.append(StoreOp(op_id, 0, slots, [srcs[i] for i in want]))
        self._count(f"store_planned_blocks.{top.name}", len(slots))
        if self.demotion == "write_through" and self.nlocal > 1:
            lower = [j for j, k in enumerate(ks) if not self.holds(k, 1)]
            lower = self._admit(1, lower, [ks[j] for j in lower], info)
            self._plan_copy(0, [(slots[j], ks[j]) for j in lower])
        if self.remote is not None:  # the fleet's tier: written through from the top tier
            r = self.remote
            up = [j for j, k in enumerate(ks) if not self.holds(k, r)]
            up = self._admit(r, up, [ks[j] for j in up], info)
            self._plan_copy(0, [(slots[j], ks[j]) for j in up], r)
        return want, op_id, deferred

    def count_dropped(self, t: int, n: int) -> None:
        """`n` blocks found no room in tier `t` (every slot pinned or being copied down)."""
        self._count(f"store_dropped_blocks.{self.names[t]}", n)

    def _admit(self, t: int, items: list, keys: Sequence[bytes], info: RequestInfo = NO_INFO) -> list:
        pol = self.admission[t]
        if pol is None or not items:
            return items
        ok = pol.admit(keys, info)
        out = [x for x, a in zip(items, ok) if a]
        if len(out) < len(items):
            self._count(f"not_admitted_blocks.{self.names[t]}", len(items) - len(out))
        return out

    def _plan_copy(self, src_tier: int, src: list[tuple[int, bytes]], t: int | None = None) -> int:
        """Copy (slot, key) blocks of `src_tier` into new slots of tier `t` (default: the next), or
        to the shared tier (no slots, no room to make: the server evicts); the sources stay
        pinned until the copy is reported durable. Returns how many."""
        t = src_tier + 1 if t is None else t
        if not src:
            return 0
        keys = [k for _, k in src]
        slots: list[int] = []
        if t != self.remote:
            room = self._room(t, len(src))
            if room < len(src):
                self._count(f"store_dropped_blocks.{self.names[t]}", len(src) - room)
                src, keys = src[:room], keys[:room]
            if not src:
                return 0
            slots = self.tiers[t].allocate(keys)
        self._pending[t].update(keys)
        self.tiers[src_tier].touch([s for s, _ in src])
        op_id = next(self._op_ids)
        self._copies[op_id] = _Copy(src_tier, src, t, slots)
        self._plan.copies.append(CopyOp(op_id, [s for s, _ in src], slots, src_tier=src_tier, tier=t, keys=keys))
        self._count(f"store_planned_blocks.{self.names[t]}", len(src))
        return len(src)

    # ---- room: eviction and write-back ---------------------------------------------------
    def _room(self, t: int, n: int) -> int:
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
            victims = tier.free_slots(need)
            if victims:
                self._evict(t, victims)
            return tier.num_free_slots
        while need > 0:
            ahead = tier.free_slots(need)
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
        self._count(f"evicted_blocks.{self.names[t]}", len(gone))
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
        self._count("miss_blocks", miss)
        self._count("miss_tokens", miss * self.block_tokens)

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

    def complete(self, rep: Report) -> None:
        """The executor's report: commit what was written, abort what failed, drop what did not
        verify, release the leases of loads that finished."""
        for t, n in rep.capacity.items():  # a data plane smaller than configured: before its results
            self._limit(t, n)
        exclusive: list[tuple[int, list[tuple[int, bytes]]]] = []
        for op_id, oks in sorted(rep.stored.items()):  # plan order, whatever order the report has
            st = self._stores.pop(op_id, None)
            if st is None:
                continue
            tier = self.tiers[st.tier]
            good = [j for j, ok in enumerate(oks[:len(st.slots)]) if ok]
            bad = [s for s, ok in zip(st.slots, oks) if not ok] + list(st.slots[len(oks):])
            if good:
                st.commit(tier, good)
                self._count(f"stored_blocks.{tier.name}", len(good))
                if st.promotion:
                    self._count(f"promoted_blocks.{tier.name}", len(good))
                    if st.exclusive_from is not None:
                        lower, src = st.exclusive_from
                        ok_keys = {k for s, k, ok in zip(st.slots, st.keys, oks) if ok}
                        exclusive.append((lower, [(s, k) for s, k in src if k in ok_keys]))
            if bad and st.promotion:  # its read failed (a miss, counted with the read): nothing to promote
                tier.abort(bad)
            elif bad:
                tier.abort(bad)
                self._count(f"store_failed_blocks.{tier.name}", len(bad))
                self.errors.append(f"tier {tier.name}: {len(bad)} of {len(st.slots)} block writes failed")
            self._pending[st.tier].difference_update(st.keys)
        for t, slots in rep.corrupt.items():  # failed verification on read: a miss from now on
            tier = self.tiers[t]
            tier.quarantine(slots)
            self._count(f"corrupt_blocks.{tier.name}", len(slots))
        for op_id, by_rank in sorted(rep.written_by_rank().items()):
            self._complete_copy(op_id, by_rank)
        if rep.gone and self.remote is not None:  # found by lookup, gone (or bad) at load: a miss
            self.tiers[self.remote].note_gone(rep.gone)
            self._count(f"gone_blocks.{self.names[self.remote]}", len(rep.gone))
        for rid, ok in rep.loaded.items():
            self.release(rid)
            if not ok:
                self._count("load_failed_requests")
        for lower, src in exclusive:  # exclusive promotion: the lower copy leaves once read up
            tier = self.tiers[lower]
            gone = [s for s, k in src if tier.find(k) == s and tier.get_block(s).ref_cnt == 0]
            if gone:
                self._evict(lower, gone)

    def _limit(self, t: int, n: int) -> None:
        tier = self.tiers[t]
        if t == self.remote or n >= tier.capacity_blocks:
            return
        was = tier.capacity_blocks
        gone = tier.limit(n)
        self._wb_max[t] = max(1, min(self._wb_max[t], n // 4))
        if gone:
            self._count(f"evicted_blocks.{tier.name}", len(gone))
        log.warning("kvtier: tier %s holds %d blocks, not the %d configured: its data plane (the workers' "
                    "pool) is smaller", tier.name, n, was)

    def _complete_copy(self, op_id: int, by_rank: dict[int, list]) -> None:
        cp = self._copies.get(op_id)
        if cp is None:
            return
        if self.ranks > 1:  # ranks write behind on their own clocks: wait for every rank's report
            cp.reports.update(by_rank)
            if len(cp.reports) < self.ranks:
                return
            by_rank = cp.reports
        del self._copies[op_id]
        tier, src_tier = self.tiers[cp.tier], self.tiers[cp.src_tier]
        sums = self._rank_sums(by_rank, len(cp.src))
        if cp.tier == self.remote:
            self._complete_put(cp, sums)
            return
        good = [(s, c) for s, c in zip(cp.slots, sums) if c != -1]
        bad = [s for s, c in zip(cp.slots, sums) if c == -1]
        if good:
            try:
                tier.commit_written([s for s, _ in good], [c for _, c in good])  # durable: now its index
            except OSError as e:  # e.g. fdatasync failed: nothing indexed, the source copy stays
                self._once(("commit", cp.tier, e.errno), logging.ERROR,
                           "kvtier: tier %s: commit of %d blocks failed, kept in %s: %s (counted in "
                           "store_failed_blocks; later failures of this kind at DEBUG)", tier.name, len(good),
                           src_tier.name, e)
                self.errors.append(f"tier {tier.name}: {e}")
                bad = [s for s, _ in good] + bad
                good = []
            else:
                self._count(f"stored_blocks.{tier.name}", len(good))
                self._count(f"demoted_blocks.{tier.name}", len(good))
        if bad:
            tier.abort(bad)
            self._count(f"store_failed_blocks.{tier.name}", len(bad))
            self._count(f"io_errors.{tier.name}", len(bad))
            self.errors.append(f"tier {tier.name}: {len(bad)} of {len(cp.slots)} block writes failed "
                               f"(kept in {src_tier.name}, not indexed)")
        self._pending[cp.tier].difference_update(k for _, k in cp.src)
        for s, k in cp.src:  # unpin the sources that still hold the same block
            src_tier.unpin_if(s, k)

    def _complete_put(self, cp: _Copy, sums: list) -> None:
        tier, src_tier = self.tiers[cp.tier], self.tiers[cp.src_tier]
        good = [k for (_, k), c in zip(cp.src, sums) if c != -1]
        if good:
            tier.note_written(good)
            self._count(f"stored_blocks.{tier.name}", len(good))
        if len(good) < len(cp.src):  # the server refused or was unreachable: counted, not retried
            self._count(f"store_failed_blocks.{tier.name}", len(cp.src) - len(good))
        self._pending[cp.tier].difference_update(k for _, k in cp.src)
        for s, k in cp.src:
            src_tier.unpin_if(s, k)

    def _rank_sums(self, by_rank: dict[int, list], n: int) -> list:
        """Per slot: the checksum (one rank), the tuple of every rank's (several), or -1 when a
        rank failed the write."""
        if self.ranks == 1:
            sums = next(iter(by_rank.values())) if len(by_rank) == 1 else by_rank.get(0, [])
            return list(sums[:n]) + [-1] * (n - len(sums))
        if sorted(by_rank) != list(range(self.ranks)):
            log.warning("kvtier: copy reported by ranks %s, expected 0..%d: its %d blocks are not committed",
                        sorted(by_rank), self.ranks - 1, n)
            return [-1] * n
        cols = [list(by_rank[r][:n]) + [-1] * (n - len(by_rank[r])) for r in range(self.ranks)]
        return [-1 if -1 in t else t for t in zip(*cols)]

    # ---- whole-stack operations ----------------------------------------------------------
    def clear(self, fresh_eviction: Sequence[Any] | None = None) -> int:
        """Drop every resident block of every tier; nothing may be leased or in flight."""
        if self.leases.leases or self._stores or self._copies:
            raise RuntimeError("clear with leases or transfers in flight")
        n = 0
        for i, t in enumerate(self.tiers[:self.nlocal]):  # never the shared tier: it is the fleet's
            slots = list(t.resident.values())
            if slots:
                t.evict(slots)
                n += len(slots)
            if fresh_eviction is not None:
                t.eviction = fresh_eviction[i]
        return n

    @property
    def in_flight(self) -> int:
        return len(self._stores) + len(self._copies)

    def pinned_blocks(self) -> int:
        return sum(t.pinned_blocks() for t in self.tiers[:self.nlocal])

    def describe(self) -> dict:
        return {"eviction": [t.eviction_name for t in self.tiers],
                "admission": [a.name if a is not None else "all" for a in self.admission],
                "promotion": self.promotion.name if self.promotion is not None else "none",
                "demotion": self.demotion}

    def stats(self) -> dict:
        return {"totals": dict(self.totals), "tiers": [t.stats() for t in self.tiers],
                "policies": self.describe(), "leases": self.leases.pinned(),
                "pending_stores": len(self._stores), "pending_copies": len(self._copies)}

    def close(self) -> None:
        pending = sum(len(c.src) for c in self._copies.values())
        if pending:
            log.warning("kvtier: %d blocks still being copied down at shutdown: not committed (misses after a "
                        "restart, never served)", pending)
            self._count("uncommitted_at_close", pending)
        self.leases.expire(float("inf"))
        for t in reversed(self.tiers):  # lower tiers first: their in-flight I/O may read an upper pool
            t.close()
