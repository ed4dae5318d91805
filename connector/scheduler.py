"""Scheduler side of the connector: a thin adapter from vLLM's scheduler hooks to the controller.

It tracks what vLLM tells about each request (block hashes -> keys, GPU block ids, how far its
blocks were offered to the store) and turns hooks into `TierController` calls:
`get_num_new_matched_tokens` -> `acquire` (a lease), `update_state_after_alloc` -> `load`,
`build_connector_meta` -> `store` for the blocks computed this step (or the lazy walk of the GPU
free queue) and `take_plan`, `update_connector_output` -> `complete`, finish -> `release`.
Every placement decision is the controller's (`kvtier.core.controller`). The API is plain (request
ids, block hashes, block ids) so tests and offline drivers use it without vLLM.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from kvtier.core.controller import PENDING, TierController
from kvtier.tiers.once import Once, cause
from kvtier.tiers.contract import Medium
from kvtier.core.keys import GROUP_ID_BYTES
from kvtier.policies import PROMOTION
from kvtier.policies.base import AdmissionPolicy, PromotionPolicy, RequestInfo
from kvtier.tiers.base import SlotTier

from .hybrid import HybridRules
from .lazy_offload import LazyOffload
from .metadata import KVTierMetadata, KVTierStats, KVTierWorkerMeta

log = logging.getLogger("kvtier.connector")


@dataclass
class _Req:
    req_id: str
    request: Any                    # vLLM Request (duck-typed: block_hashes, num_tokens)
    keys: list[bytes] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)   # group 0, chain order (own tracking)
    stored_upto: int = 0            # chain positions below this were offered to the store
    hit_blocks: int = 0             # leading blocks found (vLLM's own cache + kvtier), at lookup
    asked: int = 0                  # blocks looked up in the tiers, at the last lookup
    load_tier_blocks: dict[int, int] = field(default_factory=dict)
    load_async: bool = False        # the lease reaches the shared tier: vLLM loads it asynchronously
    load_start: int = 0             # chain position where the planned load starts
    tables: list[list[int]] = field(default_factory=list)  # hybrid: each group's block ids
    done: list[int] = field(default_factory=list)          # hybrid: blocks offered to the store, per group
    plan: list[tuple[int, int]] = field(default_factory=list)  # hybrid: (group, block index) the hit loads


class KVTierScheduler:
    def __init__(self, tiers: Sequence[SlotTier] | None = None, block_tokens: int = 1, group_id: int = 0,
                 store: bool = True, lease_timeout_s: float = 300.0, offload: str = "eager",
                 max_blocks_per_step: int | None = 64, promote: bool | PromotionPolicy | None = True,
                 admission: Sequence[AdmissionPolicy | None] | None = None, ranks: int = 1,
                 demotion: str = "write_through", controller: TierController | None = None,
                 async_shared_loads: bool = True, hybrid: HybridRules | None = None) -> None:
        """Either a built `controller` (`kvtier.core.builder`) or `tiers` (top first; an NVMe tier is
        an `NvmeControl`) and policies to build one. `promote`: a PromotionPolicy, True
        (inclusive) or False/None (serve in place).

        offload: "eager" stores each full block in the step that computes it; "lazy" walks the
        GPU free queue (`bind_gpu`) from its LRU head, at most `max_blocks_per_step` blocks a
        step, and stores the blocks kvtier lacks before vLLM reuses them.
        """
        if offload not in ("eager", "lazy"):
            raise ValueError(f"kvtier connector: offload must be 'eager' or 'lazy', got {offload!r}")
        if controller is None:
            if promote is True:
                promote = PROMOTION.get("inclusive")()
            controller = TierController(tiers or [], block_tokens=block_tokens, admission=admission,
                                        promotion=promote or None, demotion=demotion,
                                        lease_timeout_s=lease_timeout_s, ranks=ranks)
        self.ctrl = controller
        self.tiers = self.ctrl.tiers
        self.block_tokens = block_tokens
        self.store_enabled = store and bool(self.tiers)
        self.offload = offload
        self.max_blocks_per_step = max_blocks_per_step if max_blocks_per_step and max_blocks_per_step > 0 else None
        self.nvme = next((i for i, t in enumerate(self.tiers) if t.medium is Medium.FILE), None)
        self.nvme_dir: str | None = self.tiers[self.nvme].dir if self.nvme is not None else None
        self.gpu = None                      # SchedulerContext (bind_gpu)
        self.lazy: LazyOffload | None = None  # offload "lazy" once bound to the GPU pool
        self._suffix = group_id.to_bytes(GROUP_ID_BYTES, "big", signed=False)
        self._reqs: dict[str, _Req] = {}
        self.async_shared_loads = async_shared_loads and self.ctrl.remote is not None
        self.recorder = None                   # TraceRecorder (serving.record_trace), set by the connector
        self.hybrid = hybrid                   # several KV-cache groups (connector/hybrid.py), or None
        self._boundaries: dict = {}
        self._async_step: list[str] = []       # requests whose asynchronous load this step plans
        self._failed_loads: dict[str, list[int]] = {}  # accepted by vLLM, not planned: load errors
        self._once = Once(log)
        self._async_inflight: set[str] = set()  # ... until the workers report it done
        self.model_identity: str | None = None  # sent to the workers once the persistent tiers are open

    @property
    def leases(self):
        return self.ctrl.leases

    @property
    def totals(self) -> dict[str, float]:
        """The controller's counters (one set for the whole scheduler side)."""
        return self.ctrl.totals

    def _count(self, key: str, v: float = 1) -> None:
        self.ctrl.count(key, v)

    def take_interval_stats(self) -> KVTierStats | None:
        d = self.ctrl.take_interval()
        return KVTierStats(data=d) if d else None

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

    def _info(self, r: _Req, start: int) -> RequestInfo:
        return RequestInfo(keys=r.keys, start=start, hit_blocks=r.hit_blocks,
                           num_tokens=getattr(r.request, "num_tokens", 0), block_tokens=self.block_tokens,
                           now=float(getattr(r.request, "arrival_time", 0.0) or 0.0), request_id=r.req_id,
                           tenant=self.ctrl.tenants.tenant_of(r.request) if self.ctrl.tenants is not None else None)

    # ---- lookup / lease ----------------------------------------------------------------
    def lookup(self, request: Any, num_computed_tokens: int) -> int | None:
        """Tokens beyond `num_computed_tokens` the tiers can load; leases the matched blocks.

        Idempotent per request and range: asking again returns the same count and pins nothing
        new. At least one token is always left to compute. None: the shared tier is being asked
        (vLLM asks again next step; the scheduler never waits on the network).
        """
        r = self._track(request)
        if self.hybrid is not None:
            return self._lookup_groups(r, num_computed_tokens)
        bt = self.block_tokens
        start = num_computed_tokens // bt
        end = min(len(r.keys), (request.num_tokens - 1) // bt)
        if start >= end or num_computed_tokens % bt:
            self.ctrl.count("n_lookups")
            self.ctrl.release(r.req_id)
            r.asked = 0
            return 0
        r.asked = end - start
        lease = self.ctrl.acquire(r.req_id, r.keys[start:end], start, wait=False)
        if lease is PENDING:
            return None
        n = lease.num_blocks if lease is not None else 0
        r.hit_blocks = start + n
        r.load_async = self.async_shared_loads and n > 0 and any(t == self.ctrl.remote for t, _ in lease.blocks)
        return n * bt

    def _lookup_groups(self, r: _Req, local: int) -> int:
        """A hybrid model: the one hit length every group serves; leases each group's blocks."""
        q = r.request
        n, plan, keys = self.hybrid.lookup(q.block_hashes, local, q.num_tokens,
                                           lambda k: self.ctrl.find(k) is not None)
        r.asked = max(0, (q.num_tokens - 1) // self.block_tokens - local // self.block_tokens)
        if not n:
            self.ctrl.count("n_lookups")
            self.ctrl.release(r.req_id)
            return 0
        if self.ctrl.acquire_keys(r.req_id, keys) is None:
            return 0
        r.plan, r.hit_blocks, r.load_start = plan, (local + n) // self.block_tokens, local // self.block_tokens
        r.load_async = True  # vLLM takes a hybrid model's load failures per request: asynchronous loads only
        return n

    def on_alloc_groups(self, request: Any, tables: Sequence[Sequence[int]] | None, num_external_tokens: int) -> None:
        """A hybrid model's `update_state_after_alloc`: each group's block ids; the planned blocks
        load into the ones vLLM allocated for them (any missing: the hit is recomputed)."""
        r = self._track(request)
        if tables is not None:
            r.tables = [list(t) for t in tables]
        if num_external_tokens <= 0:
            if self.ctrl.release(r.req_id):
                self._count("n_leases_not_chosen")
            self.ctrl.count_request(r.asked, 0)
            r.asked = 0
            return
        dsts = self.hybrid.destinations(r.plan, r.tables)
        lease = self.ctrl.leases.leases.get(r.req_id)
        if dsts is None or lease is None or len(dsts) != lease.num_blocks:
            self._count("hybrid_alloc_mismatch")
            self._once(("hybrid_alloc",), logging.WARNING, "kvtier: request %s: vLLM's blocks differ from the "
                       "planned hit (%d blocks planned): recomputed", r.req_id, len(r.plan))
            self.fail_alloc(request, r.tables[0] if r.tables else None, num_external_tokens)
            return
        ops = self.ctrl.load(r.req_id, len(dsts), dsts, self._info(r, r.load_start), tokens=num_external_tokens)
        self.ctrl.count_request(r.asked, num_external_tokens // self.block_tokens)
        r.asked = 0
        r.load_tier_blocks = {op.tier: len(op.slots) for op in ops}
        self._wait_for(r, ops)
        self._init_done(r)
        upto = r.load_start * self.block_tokens + num_external_tokens
        for g in self.hybrid.groups:  # what was loaded is not stored again
            r.done[g.gid] = max(r.done[g.gid], upto // g.block_tokens)

    def _init_done(self, r: _Req) -> None:
        if not r.done:
            r.done = [0] * (1 + max(g.gid for g in self.hybrid.groups))

    def loads_async(self, request_id: str) -> bool:
        """Whether the request's matched prefix reaches the shared tier: vLLM then loads it
        asynchronously (the request waits, other requests run, no step waits on the network)."""
        r = self._reqs.get(request_id)
        return r is not None and r.load_async

    def on_alloc(self, request: Any, block_ids: Sequence[int] | None, num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks and accepted `num_external_tokens` from us."""
        r = self._track(request)
        if block_ids is not None:
            r.block_ids = list(block_ids)
        if num_external_tokens <= 0:
            if self.ctrl.release(r.req_id):   # not chosen (MultiConnector) or nothing to load
                self._count("n_leases_not_chosen")
            self.ctrl.count_request(r.asked, 0)
            r.asked = 0  # counted once: vLLM calls again (0 tokens) when it schedules a loaded request
            return
        lease = self.ctrl.leases.leases.get(r.req_id)
        nb = num_external_tokens // self.block_tokens
        if lease is None or nb <= 0 or block_ids is None:
            log.warning("kvtier: request %s accepted %d external tokens without a lease", r.req_id,
                        num_external_tokens)
            self.ctrl.release(r.req_id)
            return
        gpu = list(block_ids[lease.start:lease.start + min(nb, lease.num_blocks)])
        if len(gpu) < min(nb, lease.num_blocks):
            log.warning("kvtier: request %s has %d blocks, load needs %d", r.req_id, len(gpu), nb)
            self.ctrl.release(r.req_id)
            return
        ops = self.ctrl.load(r.req_id, nb, gpu, self._info(r, lease.start))
        self._wait_for(r, ops)
        n = sum(len(op.slots) for op in ops)
        self.ctrl.count_request(r.asked, n)
        r.asked = 0
        r.load_tier_blocks = {op.tier: len(op.slots) for op in ops}
        r.load_start = lease.start
        r.stored_upto = max(r.stored_upto, lease.start + n)

    def _wait_for(self, r: _Req, ops: Sequence) -> None:
        """The request waits for its asynchronous load: the workers report it done (or failed)."""
        if not r.load_async:
            return
        self._async_step.append(r.req_id)
        if ops:
            self._async_inflight.add(r.req_id)
        else:  # nothing to load after all: reported failed, or it would wait forever
            self._failed_loads[r.req_id] = []

    def hit_sources(self, request_id: str) -> dict[Medium, int]:
        """Tokens of the planned load per medium of the tiers they come from."""
        r = self._reqs.get(request_id)
        out: dict[Medium, int] = {}
        if r is not None:
            for t, n in r.load_tier_blocks.items():
                m = self.tiers[t].medium
                out[m] = out.get(m, 0) + n * self.block_tokens
        return out

    # ---- the per-step plan -------------------------------------------------------------
    def build_meta(self, scheduled: Iterable[tuple[str, int, Sequence[int] | None]],
                   boundaries: dict | None = None) -> KVTierMetadata:
        """`scheduled`: (request id, tokens computed once this step runs, its group-0 block ids or
        None to use the ids tracked from on_alloc/update_block_ids)."""
        scheduled = list(scheduled)
        self._boundaries = boundaries or {}   # hybrid: Mamba states vLLM hands over this step
        if scheduled and self.lazy is not None:
            self.lazy.drain.busy()
        try:  # a failure here (e.g. the NVMe index cannot be written) costs this step's stores only
            self.ctrl.expire()
            if self.store_enabled:
                if self.lazy is not None:
                    self.lazy.plan(self.max_blocks_per_step or (1 << 30))
                else:
                    self._plan_stores(scheduled)
        except Exception as e:  # noqa: BLE001
            self._count("store_plan_failed")
            self._once(("store_plan",) + cause(e), logging.ERROR,
                       "kvtier: planning this step's stores failed (%s: %s); they are skipped (future misses)",
                       type(e).__name__, e, exc_info=e)
        plan = self.ctrl.take_plan()
        meta = KVTierMetadata(loads=plan.loads, stores=plan.stores, copies=plan.copies,
                              remote_tier=self.ctrl.remote, tier_names=self.ctrl.names,
                              async_loads=self._async_step, failed_loads=self._failed_loads,
                              idle=not scheduled and bool(self._async_inflight),
                              model_identity=self.model_identity)
        self._async_step = []
        self._failed_loads = {}
        self._name_nvme(meta)
        return meta

    def _name_nvme(self, meta: KVTierMetadata) -> None:
        if self.nvme_dir is not None:  # the worker opens the data plane from it (loads and stores)
            meta.nvme_tier = self.nvme
            meta.nvme_dir = self.nvme_dir
            meta.nvme_capacity = self.tiers[self.nvme].capacity_blocks

    # ---- failures: the safe answer (connector/guard.py) ------------------------------------
    def fail_alloc(self, request: Any, block_ids: Sequence[int] | None, num_external_tokens: int) -> None:
        """`update_state_after_alloc` failed after vLLM accepted `num_external_tokens` from us: the
        lease goes, and the blocks vLLM expects loaded are reported as load errors (recomputed)."""
        rid = request.request_id
        self.ctrl.release(rid)
        self._async_inflight.discard(rid)
        if num_external_tokens <= 0:
            return
        r = self._reqs.get(rid)
        if r is not None and r.load_async and rid not in self._async_step:  # it waits: report it failed
            self._async_step.append(rid)
        nb = num_external_tokens // self.block_tokens
        first = int(getattr(request, "num_computed_tokens", 0) or 0) // self.block_tokens
        self._failed_loads[rid] = list(block_ids[first:first + nb]) if block_ids else []

    def fail_plan(self) -> KVTierMetadata:
        """`build_connector_meta` failed: send this step's loads as load errors (vLLM accepted them
        and must recompute them) and fail its stores and copies at once, so nothing stays pinned."""
        plan = self.ctrl.take_plan()
        failed = dict(self._failed_loads)
        for op in plan.loads:
            failed.setdefault(op.req_id, []).extend(op.block_ids)
        rep = KVTierWorkerMeta.of_plan(plan, ok=False, ranks=self.ctrl.ranks)  # every rank's, each failed
        waiting, self._failed_loads, self._async_step = self._async_step, {}, []
        self.on_worker_meta(rep)
        meta = KVTierMetadata(failed_loads=failed, async_loads=waiting, remote_tier=self.ctrl.remote,
                              tier_names=self.ctrl.names)
        self._name_nvme(meta)
        return meta

    def update_block_ids(self, req_id: str, new_ids: Sequence[int], replace: bool,
                         tables: Sequence[Sequence[int]] | None = None) -> None:
        """The request's block ids (group 0), or with `tables` every group's (a hybrid model)."""
        r = self._reqs.get(req_id)
        if r is None:
            return
        if tables is not None:
            if replace or not r.tables:
                r.tables = [list(t) for t in tables]
            else:
                for t, new in zip(r.tables, tables):
                    t.extend(new)
            return
        if replace:
            r.block_ids = list(new_ids)
        else:
            r.block_ids.extend(new_ids)

    def _plan_stores(self, scheduled: Iterable[tuple[str, int, Sequence[int] | None]]) -> None:
        bt = self.block_tokens
        for rid, computed_after, block_ids in scheduled:
            r = self._reqs.get(rid)
            if r is None:
                continue
            if self.hybrid is not None:
                self._plan_stores_groups(r, computed_after, block_ids)
                continue
            if block_ids is None:
                block_ids = r.block_ids
            self._track(r.request)
            full = min(len(r.keys), computed_after // bt, len(block_ids))
            lo = r.stored_upto
            if full <= lo:
                continue
            r.stored_upto = full
            self.ctrl.store(r.keys[lo:full], block_ids[lo:full], self._info(r, lo))

    def _plan_stores_groups(self, r: _Req, computed_after: int, tables: Any) -> None:
        """A hybrid model: each attention group's blocks full once this step runs (a sliding
        window's too: vLLM drops them at the next step) and the Mamba states vLLM hands over."""
        if tables is not None:
            r.tables = [list(t) for t in tables]
        self._init_done(r)
        pairs = self.hybrid.stores(r.request.block_hashes, computed_after, r.tables, r.done,
                                   self._boundaries.get(r.req_id, ()))
        if pairs:
            self.ctrl.store([k for k, _ in pairs], [b for _, b in pairs], self._info(r, 0))

    def has_pending_push_work(self) -> bool:
        """Lazy offload still has finished requests' blocks to write behind (connector/lazy_offload.py)."""
        return self.lazy is not None and self.lazy.pending()

    # ---- worker results ----------------------------------------------------------------
    def on_worker_meta(self, wm: KVTierWorkerMeta | None) -> None:
        if wm is None:
            return
        if self.lazy is not None:
            for op_id, oks in wm.stored.items():
                self.lazy.on_stored(op_id, oks)
        self._async_inflight.difference_update(wm.loaded)
        for rid, ok in wm.loaded.items():  # a failed load: vLLM recomputes those blocks; offer them again
            r = self._reqs.get(rid)
            if not ok and r is not None:
                r.stored_upto = min(r.stored_upto, r.load_start)
        self.ctrl.complete(wm)

    # ---- end of a request --------------------------------------------------------------
    def on_finished(self, req_id: str, block_ids: Sequence[int] | None = None) -> tuple[bool, dict | None]:
        """(delay freeing its GPU blocks, params): delayed while an asynchronous load still writes
        them (vLLM frees them when the workers report the load received). Lazy offload queues its
        full blocks (`block_ids`, group 0) to be written behind."""
        r = self._reqs.pop(req_id, None)
        if r is not None and block_ids and self.store_enabled and self.lazy is not None:
            self._track(r.request)
            self.lazy.write_behind(r.keys, block_ids)
        if r is not None and self.recorder is not None:
            q = r.request
            n_in = int(getattr(q, "num_prompt_tokens", 0) or 0)
            self.recorder.record(float(getattr(q, "arrival_time", 0.0) or 0.0), n_in,
                                 int(getattr(q, "num_output_tokens", 0) or 0),
                                 q.block_hashes[:n_in // self.block_tokens],
                                 None if (ten := self.ctrl.tenants) is None else ten.label(ten.tenant_of(q)))
        if req_id in self._async_inflight:  # its lease pins what the load still reads; the report releases it
            return True, None
        self.ctrl.release(req_id)
        return False, None

    def on_preempted(self, req_id: str) -> None:
        self.ctrl.release(req_id)
        r = self._reqs.get(req_id)
        if r is not None:
            r.block_ids = []

    # ---- introspection -----------------------------------------------------------------
    def pinned_blocks(self) -> int:
        return self.ctrl.pinned_blocks()

    def stats(self) -> dict:
        d = self.ctrl.stats()
        d.update({"gpu_pinned": self.lazy.gpu_pinned if self.lazy is not None else 0, "offload": self.offload,
                  "pending_nvme_writes": d["pending_copies"]})
        return d

    def bind_gpu(self, ctx: Any) -> None:
        """vLLM's GPU block pool (`kvtier.tiers.gpu`): lazy offload walks its free queue."""
        self.gpu = ctx
        if self.offload == "lazy":
            self.lazy = LazyOffload(self.ctrl, ctx, self._count)

    def open_tier(self, t: int, tier: SlotTier) -> None:
        """A persistent tier opened after start (`TierController.open_tier`)."""
        self.ctrl.open_tier(t, tier)
        if t == self.nvme:
            self.nvme_dir = tier.dir

    def close(self) -> None:
        self.ctrl.close()
