"""Scheduler side of the connector: the control plane.

Holds the index of what lives in which tier slot (`SlotTier` objects, metadata only), the
leases that pin matched blocks between lookup and load, and the per-step load/store plan sent
to the workers. It never touches bytes. The API is plain (request ids, block hashes, block
ids) so unit tests and offline drivers use it without vLLM.

Block life: a full block computed on the GPU gets a reserved (pending) slot in the plan of the
step that computes it; the worker copies it after the forward and reports per-block success;
only then is the slot committed (visible to lookups). A lookup leases (pins) the matched slots;
`on_alloc` commits the accepted prefix and plans the load; the worker's report of the load (or
the request's end) releases the lease.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from kvtier.keys import GROUP_ID_BYTES
from kvtier.leases import LeaseTable
from kvtier.policies.base import _NO_INFO, AdmissionPolicy, RequestInfo
from kvtier.tiers.base import SlotTier, group_by_tier, match_prefix

from .metadata import Counting, KVTierMetadata, KVTierWorkerMeta, LoadOp, NvmeWriteOp, StoreOp

log = logging.getLogger("kvtier.connector")


@dataclass
class _Req:
    req_id: str
    request: Any                    # vLLM Request (duck-typed: block_hashes, num_tokens)
    keys: list[bytes] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)   # group 0, chain order (own tracking)
    stored_upto: int = 0            # chain positions below this were offered to the store
    loaded_blocks: int = 0          # external hit blocks accepted (stats, hit sources)
    hit_blocks: int = 0             # leading blocks found (vLLM's own cache + kvtier), at lookup
    load_tier_blocks: dict[int, int] = field(default_factory=dict)


class KVTierScheduler(Counting):
    def __init__(self, tiers: Sequence[SlotTier], block_tokens: int, group_id: int = 0,
                 store: bool = True, lease_timeout_s: float = 300.0, offload: str = "eager",
                 max_blocks_per_step: int | None = 64, promote: bool = True,
                 admission: Sequence[AdmissionPolicy | None] | None = None, ranks: int = 1) -> None:
        """`tiers`: tier 0 is the CPU tier; an NVMe tier (kind "nvme", an `NvmeControl`) may follow.
        `admission[i]`: whether a block is worth writing to tier i (None: every block).
        `ranks`: workers that each hold a shard of every block (an NVMe block is committed once
        every rank reported its shard written, with one checksum per rank).

        offload: "eager" stores each full block in the step that computes it; "lazy" walks the
        GPU free queue (`bind_gpu`) from its LRU head, at most `max_blocks_per_step` blocks a
        step, and stores the blocks kvtier lacks before vLLM reuses them.
        """
        if offload not in ("eager", "lazy"):
            raise ValueError(f"kvtier connector: offload must be 'eager' or 'lazy', got {offload!r}")
        self.tiers = list(tiers)
        self.block_tokens = block_tokens
        self.store_enabled = store and bool(self.tiers)
        self.offload = offload
        self.max_blocks_per_step = max_blocks_per_step if max_blocks_per_step and max_blocks_per_step > 0 else None
        self.promote = promote
        self.ranks = max(1, int(ranks))
        self._index = [t._slot_of for t in self.tiers]   # read-only fast path over the tiers' indexes
        adm = list(admission or [])
        self.admission: list[AdmissionPolicy | None] = [a if a is None or a.name != "all" else None
                                                        for a in adm + [None] * (len(self.tiers) - len(adm))]
        self.nvme = next((i for i, t in enumerate(self.tiers) if t.kind == "nvme"), None)
        self.nvme_dir: str | None = getattr(self.tiers[self.nvme], "dir", None) if self.nvme is not None else None
        self.gpu = None                      # SchedulerContext (lazy offload)
        self._cursor: int | None = None      # lazy offload: resume the free-queue walk after this block
        self._gpu_pinned: dict[int, list[int]] = {}       # store op -> GPU blocks protected for its copy
        self._nvme_writes: dict[int, tuple[list[int], list[tuple[int, bytes]]]] = {}  # op -> nvme slots, cpu src
        self._nvme_reports: dict[int, dict[int, list[int]]] = {}  # op -> rank -> checksums, until every rank reported
        self._lazy_keys: set[bytes] = set()
        self._suffix = group_id.to_bytes(GROUP_ID_BYTES, "big", signed=False)
        self.leases = LeaseTable(pin=self._pin, unpin=self._unpin, timeout_s=lease_timeout_s)
        self._reqs: dict[str, _Req] = {}
        self._load_plan: dict[str, list[LoadOp]] = {}
        self._pending_stores: dict[int, tuple[int, list[int], list[bytes]]] = {}
        self._pending_keys: set[bytes] = set()
        self._op_ids = itertools.count(1)
        self._init_counters()

    # ---- pins over (tier, slot) ------------------------------------------------------
    def _pin(self, blocks: Sequence[tuple[int, int]]) -> None:
        for t, slots in group_by_tier(blocks).items():
            self.tiers[t].touch(slots)

    def _unpin(self, blocks: Sequence[tuple[int, int]]) -> None:
        for t, slots in group_by_tier(blocks).items():
            self.tiers[t].free_blocks(slots)

    # ---- requests ----------------------------------------------------------------------
    def _track(self, request: Any) -> _Req:
        rid = request.request_id
        r = self._reqs.get(rid)
        if r is None:
            r = self._reqs[rid] = _Req(rid, request)
        else:
            r.request = request
        hashes = request.block_hashes
        if len(r.keys) < len(hashes):
            sfx = self._suffix
            r.keys.extend(bytes(h) + sfx for h in hashes[len(r.keys):])
        return r

    # ---- lookup / lease ----------------------------------------------------------------
    def lookup(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens beyond `num_computed_tokens` the tiers can load; leases the matched blocks.

        Idempotent per request and range: asking again returns the same count and pins nothing
        new. At least one token is always left to compute.
        """
        r = self._track(request)
        bt = self.block_tokens
        start = num_computed_tokens // bt
        end = min(len(r.keys), (request.num_tokens - 1) // bt)
        self._count("n_lookups")
        if start >= end or num_computed_tokens % bt:
            self.leases.release(r.req_id)
            return 0
        want = r.keys[start:end]
        r.hit_blocks = start
        lease = self.leases.get(r.req_id, start, want)
        if lease is None:
            blocks = list(zip(*match_prefix(self._index, want)))
            if not blocks:
                self.leases.release(r.req_id)
                return 0
            lease = self.leases.take(r.req_id, start, want, blocks)
        r.hit_blocks = start + lease.num_blocks
        return lease.num_blocks * bt

    def on_alloc(self, request: Any, block_ids: Sequence[int] | None, num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks and accepted `num_external_tokens` from us."""
        r = self._track(request)
        if block_ids is not None:
            r.block_ids = list(block_ids)
        if num_external_tokens <= 0:
            if self.leases.release(r.req_id):   # not chosen (MultiConnector) or nothing to load
                self._count("n_leases_not_chosen")
            return
        lease = self.leases.leases.get(r.req_id)
        nb = num_external_tokens // self.block_tokens
        if lease is None or nb <= 0 or block_ids is None:
            log.warning("kvtier: request %s accepted %d external tokens without a lease", r.req_id,
                        num_external_tokens)
            self.leases.release(r.req_id)
            return
        lease = self.leases.commit(r.req_id, nb)
        assert lease is not None
        gpu = list(block_ids[lease.start:lease.start + lease.num_blocks])
        if len(gpu) < lease.num_blocks:
            log.warning("kvtier: request %s has %d blocks, load needs %d", r.req_id, len(gpu), lease.num_blocks)
            self.leases.release(r.req_id)
            return
        ops: dict[int, LoadOp] = {}
        keys_of: dict[int, list[bytes]] = {}
        for (t, s), b, k in zip(lease.blocks, gpu, lease.keys):
            op = ops.get(t)
            if op is None:
                op = ops[t] = LoadOp(r.req_id, t, [], [])
                keys_of[t] = []
            op.slots.append(s)
            op.block_ids.append(b)
            keys_of[t].append(k)
        for t, op in ops.items():
            if self.tiers[t].kind == "nvme":
                op.checksums = self.tiers[t].checksums(op.slots)
                op.keys = keys_of[t]
                if self.promote and t > 0:
                    self._plan_promotion(op, keys_of[t])
        self._load_plan[r.req_id] = list(ops.values())
        r.loaded_blocks = lease.num_blocks
        r.load_tier_blocks = {t: len(op.slots) for t, op in ops.items()}
        r.stored_upto = max(r.stored_upto, lease.start + lease.num_blocks)
        for t, op in ops.items():
            tier = self.tiers[t]
            tier.hit(op.slots)
            self._count(f"hit_blocks.{tier.name}", len(op.slots))
            self._count(f"hit_tokens.{tier.name}", len(op.slots) * self.block_tokens)
        self._count("hit_tokens", lease.num_blocks * self.block_tokens)
        self._count("n_loads")

    def hit_sources(self, request_id: str) -> dict[str, int]:
        """Tokens of the planned load per tier name."""
        r = self._reqs.get(request_id)
        if r is None:
            return {}
        return {self.tiers[t].name: n * self.block_tokens for t, n in r.load_tier_blocks.items() if n}

    # ---- the per-step plan -------------------------------------------------------------
    def build_meta(self, scheduled: Iterable[tuple[str, int, Sequence[int] | None]]) -> KVTierMetadata:
        """`scheduled`: (request id, tokens computed once this step runs, its group-0 block ids or
        None to use the ids tracked from on_alloc/update_block_ids)."""
        meta = KVTierMetadata()
        for ops in self._load_plan.values():
            meta.loads.extend(ops)
        self._load_plan.clear()
        if self.nvme_dir is not None:  # the worker opens the data plane from it (loads and stores)
            meta.nvme_dir = self.nvme_dir
            meta.nvme_capacity = self.tiers[self.nvme].capacity_blocks
        self.leases.expire()
        if self.store_enabled:
            self._plan_stores(scheduled, meta)
        return meta

    def update_block_ids(self, req_id: str, new_ids: Sequence[int], replace: bool) -> None:
        r = self._reqs.get(req_id)
        if r is None:
            return
        if replace:
            r.block_ids = list(new_ids)
        else:
            r.block_ids.extend(new_ids)

    def _plan_stores(self, scheduled: Iterable[tuple[str, int, Sequence[int] | None]], meta: KVTierMetadata) -> None:
        if self.offload == "lazy" and self.gpu is not None:
            self._plan_lazy(meta)
            return
        bt = self.block_tokens
        cpu = self.tiers[0]
        keys: list[bytes] = []
        gpu: list[int] = []
        to_nvme: set[bytes] = set()
        for rid, computed_after, block_ids in scheduled:
            r = self._reqs.get(rid)
            if r is None:
                continue
            if block_ids is None:
                block_ids = r.block_ids
            self._track(r.request)
            full = min(len(r.keys), computed_after // bt, len(block_ids))
            new = [p for p in range(r.stored_upto, full) if r.keys[p] not in self._pending_keys and r.keys[p] not in cpu]
            if full > r.stored_upto:
                r.stored_upto = full
            if not new:
                continue
            info = RequestInfo(keys=r.keys, start=new[0], hit_blocks=r.hit_blocks,
                               num_tokens=getattr(r.request, "num_tokens", 0), block_tokens=bt, request_id=rid)
            new = self._admit(0, new, [r.keys[p] for p in new], info)
            if self.nvme is not None and new:
                nk = [r.keys[p] for p in new]
                to_nvme.update(nk[i] for i in self._admit(self.nvme, range(len(nk)), nk, info))
            for p in new:
                self._pending_keys.add(r.keys[p])
                keys.append(r.keys[p])
                gpu.append(block_ids[p])
        if keys:
            self._plan_store(keys, gpu, meta, to_nvme)

    def _admit(self, t: int, items: Sequence, keys: Sequence[bytes], info: RequestInfo = _NO_INFO) -> list:
        """The items whose keys tier `t`'s admission policy admits (all without one); counts the rest."""
        pol = self.admission[t]
        if pol is None:
            return list(items)
        ok = pol.admit(keys, info)
        out = [x for x, a in zip(items, ok) if a]
        if len(out) < len(ok):
            self._count(f"not_admitted_blocks.{self.tiers[t].name}", len(ok) - len(out))
        return out

    def _plan_lazy(self, meta: KVTierMetadata) -> None:
        """Walk the GPU free queue from the cursor (LRU head first); protect and store up to
        `max_blocks_per_step` hashed blocks kvtier lacks. Scans at most 8x that many blocks."""
        budget = self.max_blocks_per_step
        scan = None if budget is None else 8 * budget
        cpu = self.tiers[0]
        keys: list[bytes] = []
        gpu: list[int] = []
        last = None
        seen = 0
        exhausted = True
        for b in self.gpu.iter_free_blocks(self._cursor):
            if scan is not None and seen >= scan:
                exhausted = False
                break
            seen += 1
            k = b.block_hash
            if k is None or k in self._pending_keys or k in cpu:
                last = b.block_id
                continue
            if self.admission[0] is not None and not self._admit(0, (k,), (k,)):
                last = b.block_id
                continue
            keys.append(k)
            gpu.append(b.block_id)
            if budget is not None and len(keys) >= budget:
                exhausted = False
                break
        self._cursor = None if exhausted else last
        self._count("n_lazy_scanned", seen)
        if not keys:
            return
        self.gpu.touch(gpu)                 # vLLM cannot reuse them until the copy is done
        self._pending_keys.update(keys)
        to_nvme = None
        if self.nvme is not None and self.admission[self.nvme] is not None:
            to_nvme = set(self._admit(self.nvme, keys, keys))
        op_id = self._plan_store(keys, gpu, meta, to_nvme)
        if op_id is None:
            self.gpu.free_blocks(gpu)
        else:
            self._gpu_pinned[op_id] = list(gpu)
            self._count("lazy_offload_blocks", len(gpu))

    def _cpu_room(self, n: int) -> int:
        """Evict unpinned CPU blocks until `n` slots are free (or nothing more can go); free slots."""
        self._make_room(0, n)
        return self.tiers[0].num_free_slots

    def _make_room(self, t: int, n: int) -> None:
        """Evict unpinned blocks of tier `t`, head of its cursor first, until `n` slots are free."""
        tier = self.tiers[t]
        need = n - tier.num_free_slots
        if need <= 0:
            return
        victims = tier.free_slots(need)
        if not victims:
            return
        gone = tier.evict(victims)
        self._count(f"evicted_blocks.{tier.name}", len(victims))
        pol = self.admission[t]
        if pol is not None:  # ghost history of admission policies that keep one
            for k in gone:
                pol.on_evict(k)

    def _plan_store(self, keys: list[bytes], gpu: list[int], meta: KVTierMetadata,
                    to_nvme: set[bytes] | None = None) -> int | None:
        """GPU blocks -> CPU slots, and (write-through) those CPU slots -> NVMe for keys NVMe lacks
        (only `to_nvme` keys when given: NVMe admission)."""
        tier = self.tiers[0]
        n = min(len(keys), self._cpu_room(len(keys)))
        if n < len(keys):
            self._count(f"store_dropped_blocks.{tier.name}", len(keys) - n)
            for k in keys[n:]:
                self._pending_keys.discard(k)
            keys, gpu = keys[:n], gpu[:n]
        if not keys:
            return None
        slots = tier.allocate(keys)
        op_id = next(self._op_ids)
        self._pending_stores[op_id] = (0, slots, keys)
        meta.stores.append(StoreOp(op_id, 0, slots, gpu))
        self._count(f"store_planned_blocks.{tier.name}", len(slots))
        if self.nvme is not None:
            src = list(zip(slots, keys))
            if to_nvme is not None:
                src = [(s, k) for s, k in src if k in to_nvme]
            self._plan_nvme_write(src, meta)
        return op_id

    def _plan_nvme_write(self, src: list[tuple[int, bytes]], meta: KVTierMetadata) -> None:
        nv = self.tiers[self.nvme]
        src = [(s, k) for s, k in src if k not in nv]
        if not src:
            return
        self._make_room(self.nvme, len(src))
        src = src[:nv.num_free_slots]
        if not src:
            return
        slots = nv.allocate([k for _, k in src])
        cpu = self.tiers[0]
        cpu.touch([s for s, _ in src])      # the CPU copy is the source until the write is durable
        op_id = next(self._op_ids)
        self._nvme_writes[op_id] = (slots, src)
        meta.nvme_writes.append(NvmeWriteOp(op_id, [s for s, _ in src], slots, [k for _, k in src]))
        self._count(f"store_planned_blocks.{nv.name}", len(slots))

    def _plan_promotion(self, op: LoadOp, keys: list[bytes]) -> None:
        """Read an NVMe load through fresh CPU slots (inclusive promotion at no extra copy)."""
        cpu = self.tiers[0]
        want = [k for k in keys if k not in cpu and k not in self._pending_keys]
        if len(want) != len(keys) or self._cpu_room(len(keys)) < len(keys):
            return
        slots = cpu.allocate(keys)
        self._pending_keys.update(keys)
        op.via = slots
        op.op_id = next(self._op_ids)
        self._pending_stores[op.op_id] = (0, slots, list(keys))

    # ---- worker results ----------------------------------------------------------------
    def on_worker_meta(self, wm: KVTierWorkerMeta | None) -> None:
        if wm is None:
            return
        for op_id, oks in wm.stored.items():
            entry = self._pending_stores.pop(op_id, None)
            pinned = self._gpu_pinned.pop(op_id, None)
            if pinned is not None and self.gpu is not None:
                self.gpu.free_blocks(pinned)
            if entry is None:
                continue
            t, slots, keys = entry
            tier = self.tiers[t]
            good = [s for s, ok in zip(slots, oks) if ok]
            bad = [s for s, ok in zip(slots, oks) if not ok] + list(slots[len(oks):])
            if good:
                tier.commit(good)
                self._count(f"stored_blocks.{tier.name}", len(good))
            if bad:
                tier.abort(bad)
                self._count(f"store_failed_blocks.{tier.name}", len(bad))
            for k in keys:
                self._pending_keys.discard(k)
        for t, slots in wm.corrupt.items():
            tier = self.tiers[t]
            if hasattr(tier, "quarantine"):
                n = tier.quarantine(slots)
                self._count(f"corrupt_blocks.{tier.name}", n)
        for op_id, by_rank in wm.written_by_rank().items():
            if op_id not in self._nvme_writes:
                continue
            if self.ranks > 1:  # ranks write behind on their own clocks: wait for every rank's report
                got = self._nvme_reports.setdefault(op_id, {})
                got.update(by_rank)
                if len(got) < self.ranks:
                    continue
                by_rank = self._nvme_reports.pop(op_id)
            slots, src = self._nvme_writes.pop(op_id)
            nv, cpu = self.tiers[self.nvme], self.tiers[0]
            sums = self._rank_sums(by_rank, len(slots))
            good = [(s, c) for s, c in zip(slots, sums) if c != -1]
            bad = [s for s, c in zip(slots, sums) if c == -1]
            if good:  # data written and fdatasync'd by the worker: now the durable index commit
                nv.commit_written([s for s, _ in good], [c for _, c in good])
                self._count(f"stored_blocks.{nv.name}", len(good))
            if bad:
                nv.abort(bad)
                self._count(f"store_failed_blocks.{nv.name}", len(bad))
            for s, k in src:  # unpin the CPU sources that are still the same block
                if cpu._key_of[s] == k and cpu._ref[s] > 0:
                    cpu.free_blocks([s])
        for rid, ok in wm.loaded.items():
            self.leases.release(rid)
            if not ok:
                self._count("load_failed_requests")

    def _rank_sums(self, by_rank: dict[int, list[int]], n: int) -> list[int | tuple[int, ...]]:
        """Per slot: the checksum (one rank), the tuple of every rank's (several), or -1 when a
        rank failed the write."""
        if self.ranks == 1:
            sums = next(iter(by_rank.values())) if len(by_rank) == 1 else by_rank.get(0, [])
            return list(sums[:n]) + [-1] * (n - len(sums))
        if sorted(by_rank) != list(range(self.ranks)):
            log.warning("kvtier: NVMe write reported by ranks %s, expected 0..%d: its %d blocks are not committed",
                        sorted(by_rank), self.ranks - 1, n)
            return [-1] * n
        cols = [list(by_rank[r][:n]) + [-1] * (n - len(by_rank[r])) for r in range(self.ranks)]
        return [-1 if -1 in t else t for t in zip(*cols)]

    # ---- end of a request --------------------------------------------------------------
    def on_finished(self, req_id: str) -> tuple[bool, dict | None]:
        self._load_plan.pop(req_id, None)
        self.leases.release(req_id)
        self._reqs.pop(req_id, None)
        return False, None

    def on_preempted(self, req_id: str) -> None:
        self.leases.release(req_id)
        r = self._reqs.get(req_id)
        if r is not None:
            r.block_ids = []

    # ---- introspection -----------------------------------------------------------------
    def pinned_blocks(self) -> int:
        return sum(sum(t._ref) for t in self.tiers)

    def stats(self) -> dict:
        return {"totals": dict(self.totals), "tiers": [t.stats() for t in self.tiers],
                "leases": self.leases.pinned(), "pending_stores": len(self._pending_stores),
                "pending_nvme_writes": len(self._nvme_writes), "gpu_pinned": sum(map(len, self._gpu_pinned.values())),
                "offload": self.offload}

    def bind_gpu(self, ctx: Any) -> None:
        self.gpu = ctx

    def close(self) -> None:
        pending = sum(len(slots) for slots, _ in self._nvme_writes.values())
        if pending:
            log.warning("kvtier: %d NVMe blocks still unreported at shutdown: not committed to the index "
                        "(misses after a restart, never served)", pending)
            self._count("nvme_uncommitted_at_close", pending)
        for t in self.tiers:
            c = getattr(t, "close", None)
            if c is not None:
                c()
