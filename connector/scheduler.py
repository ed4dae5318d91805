"""Scheduler side of the connector: a thin adapter from vLLM's scheduler hooks to the controller.

It tracks what vLLM tells about each request (block hashes -> keys, each KV-cache group's block
ids, how far its blocks were offered to the store) and turns hooks into `TierController` calls:
`get_num_new_matched_tokens` -> `acquire` (a lease), `update_state_after_alloc` -> `load`,
`build_connector_meta` -> `store` for the blocks computed this step (or the lazy walk of the GPU
free queue) and `take_plan`, `update_connector_output` -> `complete`, finish -> `release`.
Every model runs one path: the group rules (`groups.GroupRules`) say which blocks a hit loads
and a step stores; a one-group model is their one-group case. Every placement decision is the
controller's (`kvtier.core.controller`). The API is plain (request ids, block hashes, block ids
per group) so tests and offline drivers use it without vLLM.

What else the scheduler side owns, each with its request-level rule: the persistent tiers that
open once the model's identity is known (`PersistentTiers`), requests with a LoRA adapter that
pass through (`LoraGate`), finished requests held while their stores copy (`StoreHolds`), and
each hook's safe answer when it fails (`lookup_failed`, `alloc_failed`, ...).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from kvtier.common.counters import Metric
from kvtier.common.once import Once, cause
from kvtier.core.builder import build_tier, build_tiers
from kvtier.core.controller import PENDING, TierController
from kvtier.core.identity import ModelIdentity
from kvtier.policies.base import RequestInfo
from kvtier.tiers.base import SlotTier
from kvtier.tiers.contract import Medium
from kvtier.tiers.redact import redact

from .groups import GroupRules
from .lazy_offload import LazyOffload
from .metadata import HOLD_LIMIT_S, KVTierMetadata, KVTierStats, KVTierWorkerMeta, block_ids_of

log = logging.getLogger("kvtier.connector")

Tables = Sequence[Sequence[int]]   # block ids per KV-cache group (vLLM's `KVCacheBlocks.get_block_ids()`)


@dataclass(frozen=True)
class SchedulerOptions:
    """store: store computed blocks at all. offload: "eager" stores each full block in the step
    that computes it; "lazy" walks the GPU free queue (`bind_gpu`) from its LRU head, at most
    `max_blocks_per_step` blocks a step, and stores the blocks kvtier lacks before vLLM reuses
    them (one-group models with prefix caching; else eager). async_shared_loads: a hit that
    reaches the shared tier loads asynchronously. async_lower_loads: a hit that reaches any tier
    below DRAM (NVMe, the shared tier) does (a device: its reads never delay the forward's
    launch; they run after it, the copies queued when they land). hold_stores: stores complete in a later step
    (a GPU): a finished request is held while its stores are unreported (`StoreHolds`)."""
    store: bool = True
    offload: str = "eager"
    max_blocks_per_step: int | None = 64
    async_shared_loads: bool = True
    async_lower_loads: bool = False
    hold_stores: bool = False

    def __post_init__(self) -> None:
        if self.offload not in ("eager", "lazy"):
            raise ValueError(f"kvtier connector: offload must be 'eager' or 'lazy', got {self.offload!r}")


@dataclass
class _Req:
    req_id: str
    request: Any                    # vLLM Request (duck-typed: block_hashes, num_tokens)
    keys: list[bytes] = field(default_factory=list)      # the first group's keys, chain order
    tables: list[list[int]] = field(default_factory=list)  # each group's block ids
    done: list[int] = field(default_factory=list)        # blocks offered to the store, per group
    hit_blocks: int = 0             # leading blocks found (vLLM's own cache + kvtier), at lookup
    asked: int = 0                  # blocks looked up in the tiers, at the last lookup
    hit: int = 0                    # tokens the last lookup found
    load_tier_blocks: dict[int, int] = field(default_factory=dict)
    load_async: bool = False        # vLLM loads the hit asynchronously (shared tier, several groups)
    load_start: int = 0             # chain position where the planned load starts
    plan: list[tuple[int, int]] = field(default_factory=list)  # (group, block index) the hit loads
    deferred: int = 0               # blocks the last store found no room for: offered again next step


class KVTierScheduler:
    def __init__(self, controller: TierController, rules: GroupRules | None = None,
                 options: SchedulerOptions = SchedulerOptions(), recorder: Any = None,
                 model_identity: str | None = None) -> None:
        """`controller`: the tier stack (`kvtier.core.builder.build_controller`). `rules`: the
        model's KV-cache groups (default: one full-attention group of the controller's blocks).
        `recorder`: a TraceRecorder (serving.record_trace) or None. `model_identity`: sent to
        the workers (None until the persistent tiers open, `persistent_open`)."""
        self.ctrl = controller
        self.tiers = self.ctrl.tiers
        self.block_tokens = controller.block_tokens
        self.rules = rules or GroupRules.one_group(self.block_tokens)
        self.options = options
        self.store_enabled = options.store and bool(self.tiers)
        self.offload = "eager"                 # "lazy" once bound to a GPU pool it can walk
        mb = options.max_blocks_per_step
        self.max_blocks_per_step = mb if mb and mb > 0 else None
        self.nvme = next((i for i, t in enumerate(self.tiers) if t.medium is Medium.FILE), None)
        self.nvme_dir: str | None = self.tiers[self.nvme].dir if self.nvme is not None else None
        self.lazy: LazyOffload | None = None   # offload "lazy" once bound to the GPU pool
        self._reqs: dict[str, _Req] = {}
        self.async_shared_loads = options.async_shared_loads and self.ctrl.shared is not None
        self.recorder = recorder
        self._boundaries: dict = {}
        self._async_step: list[str] = []       # requests whose asynchronous load this step plans
        self._failed_loads: dict[str, list[int]] = {}  # accepted by vLLM, not planned: load errors
        self._once = Once(log)
        self._async_inflight: set[str] = set()  # ... until the workers report it done
        self.model_identity = model_identity
        self.holds = StoreHolds(options.hold_stores)  # finished requests vLLM keeps for their stores
        self.reused = ReusedBlocks(options.hold_stores)  # blocks vLLM may rewrite under a store still copying
        self.lora = LoraGate(self.count)                # LoRA requests pass through (`LoraGate`)

    @property
    def leases(self):
        return self.ctrl.leases

    @property
    def totals(self) -> dict[str, float]:
        """The controller's counters (one set for the whole scheduler side)."""
        return self.ctrl.totals

    def count(self, key: str, v: float = 1) -> None:
        self.ctrl.count(key, v)

    def take_interval_stats(self) -> KVTierStats | None:
        d = self.ctrl.take_interval()
        return KVTierStats(data=d) if d else None

    # ---- requests ----------------------------------------------------------------------
    def _track(self, request: Any) -> _Req:
        rid = request.request_id
        r = self._reqs.get(rid)
        if r is None:
            r = self._reqs[rid] = _Req(rid, request, done=self.rules.new_done())
        else:
            r.request = request
        hashes = request.block_hashes
        r.keys.extend(self.rules.chain_keys(hashes, len(r.keys), len(hashes)))
        return r

    def _info(self, r: _Req, start: int) -> RequestInfo:
        return RequestInfo(keys=r.keys, start=start, hit_blocks=r.hit_blocks,
                           num_tokens=getattr(r.request, "num_tokens", 0), block_tokens=self.block_tokens,
                           now=float(getattr(r.request, "arrival_time", 0.0) or 0.0), request_id=r.req_id,
                           tenant=self.ctrl.tenants.tenant_of(r.request) if self.ctrl.tenants is not None else None)

    # ---- lookup / lease ----------------------------------------------------------------
    def lookup(self, request: Any, num_computed_tokens: int) -> int | None:
        """Tokens beyond `num_computed_tokens` the tiers can load, the one hit length every group
        serves; leases the matched blocks.

        Idempotent per request and range: asking again returns the same count and pins nothing
        new. At least one token is always left to compute. None: the shared tier is being asked
        (vLLM asks again next step; the scheduler never waits on the network).
        """
        if self.lora.passes_through(request):
            return 0
        r = self._track(request)
        bt = self.block_tokens
        start = num_computed_tokens // bt
        end = min(len(request.block_hashes) * self.rules.hash_tokens, request.num_tokens - 1) // bt
        r.asked = max(0, end - start) if not num_computed_tokens % bt else 0
        if not r.asked:
            self.ctrl.count(Metric.N_LOOKUPS.key)
            self.ctrl.release(r.req_id)
            return 0
        hit = self._lease(r, num_computed_tokens, end)
        if hit is PENDING:
            return None
        n, plan, shared, lower = hit
        r.plan, r.hit, r.hit_blocks, r.load_start = plan, n, start + n // bt, start
        r.load_async = n > 0 and (not self.rules.chain or self.async_shared_loads and shared
                                  or self.options.async_lower_loads and lower)
        return n

    def _lease(self, r: _Req, local: int, end: int) -> tuple[int, list[tuple[int, int]], bool, bool] | Any:
        """(the hit's tokens, the (group, block index) it loads, whether the shared tier serves
        some, whether a tier below DRAM does), or PENDING. A chain leases its present prefix, the shared tier asked too; several
        groups lease exactly the blocks every group needs from the local tiers."""
        start = local // self.block_tokens
        if self.rules.chain:
            lease = self.ctrl.acquire(r.req_id, r.keys[start:end], start, wait=False)
            if lease is PENDING:
                return PENDING
            if lease is None:
                return 0, [], False, False
            gid = self.rules.groups[0].gid
            return (lease.num_blocks * self.block_tokens, [(gid, start + j) for j in range(lease.num_blocks)],
                    any(t == self.ctrl.shared for t, _ in lease.blocks),
                    any(self.ctrl.tiers[t].medium is not Medium.HOST for t, _ in lease.blocks))
        q = r.request
        n, plan, keys = self.rules.lookup(q.block_hashes, local, q.num_tokens, lambda k: self.ctrl.find(k) is not None)
        if not n:
            self.ctrl.count(Metric.N_LOOKUPS.key)
            self.ctrl.release(r.req_id)
            return 0, [], False, False
        if self.ctrl.acquire_keys(r.req_id, keys) is None:
            return 0, [], False, False
        return n, plan, False, False

    def loads_async(self, request_id: str) -> bool:
        """Whether vLLM loads the request's matched prefix asynchronously (the request waits,
        other requests run, no step waits on the network or on a hybrid model's load)."""
        r = self._reqs.get(request_id)
        return r is not None and r.load_async

    def on_alloc(self, request: Any, tables: Tables | None, num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks (`tables`: each group's block ids) and accepted
        `num_external_tokens` from us: the planned blocks load into the ones vLLM allocated for
        them (any missing: the accepted tokens are reported as load errors, recomputed)."""
        self.reused.add(tables)   # any request's, a LoRA one's too: a store may still read them
        if self.lora.passes_through(request):
            return
        r = self._track(request)
        if tables is not None:
            r.tables = [list(t) for t in tables]
        if num_external_tokens <= 0:
            if self.ctrl.release(r.req_id):   # not chosen (MultiConnector) or nothing to load
                self.count(Metric.N_LEASES_NOT_CHOSEN.key)
            self.ctrl.count_request(r.asked, 0)
            r.asked = 0  # counted once: vLLM calls again (0 tokens) when it schedules a loaded request
            return
        plan = self.rules.accepted(r.plan, r.load_start, num_external_tokens)
        dsts = self.rules.destinations(plan, r.tables)
        if not dsts or self.ctrl.leased(r.req_id) < len(dsts):
            self.count(Metric.ALLOC_MISMATCH.key)
            self._once(("alloc_mismatch",), logging.WARNING, "kvtier: request %s: vLLM's blocks differ from "
                       "the planned hit (%d blocks planned, %d tokens accepted): recomputed", r.req_id,
                       len(r.plan), num_external_tokens)
            self.fail_alloc(request, r.tables, num_external_tokens)
            return
        covered = min(num_external_tokens, r.hit)
        ops = self.ctrl.load(r.req_id, len(dsts), dsts, self._info(r, r.load_start), tokens=covered)
        self.ctrl.count_request(r.asked, covered // self.block_tokens)
        r.asked = 0
        r.load_tier_blocks = {op.tier: len(op.slots) for op in ops}
        self._wait_for(r, ops)
        self.rules.mark_loaded(r.done, r.load_start * self.block_tokens + covered)

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
    def on_step(self, so: Any) -> KVTierMetadata:
        """vLLM's `SchedulerOutput`: each scheduled request's block ids (vLLM's exact tables when
        it offers them, 0.32+) and the Mamba states it hands over this step; then `build_meta`."""
        self.preempted(getattr(so, "preempted_req_ids", None) or ())
        if self.recorder is not None:   # the prefill speed the trace states (plan's cost model)
            self.recorder.scheduled(so)
        nst = so.num_scheduled_tokens
        scheduled: list[tuple[str, int, Any]] = []
        for nr in so.scheduled_new_reqs:
            self.reused.add(nr.block_ids)
            self.update_block_ids(nr.req_id, nr.block_ids or (), True)
            scheduled.append((nr.req_id, nr.num_computed_tokens + nst.get(nr.req_id, 0), None))
        cr = so.scheduled_cached_reqs
        resumed = getattr(cr, "resumed_req_ids", set()) or set()
        for i, rid in enumerate(cr.req_ids):
            nb = cr.new_block_ids[i]
            self.reused.add(nb)
            if nb is not None or rid in resumed:
                self.update_block_ids(rid, nb or (), rid in resumed)
            scheduled.append((rid, cr.num_computed_tokens[i] + nst.get(rid, 0), None))
        for c in getattr(so, "kv_cache_block_copies", None) or ():   # written before the forward
            self.reused.add([[c.dst_block_id]])
        bstate = getattr(so, "kv_connector_block_state", None)
        boundaries = {}
        if bstate is not None:
            scheduled = [(rid, n, bstate.get_block_ids(rid)) for rid, n, _ in scheduled]
            boundaries = dict(getattr(bstate, "boundary_state_offloads", None) or {})
        return self.build_meta(scheduled, boundaries)

    def build_meta(self, scheduled: Iterable[tuple[str, int, Tables | None]],
                   boundaries: dict | None = None) -> KVTierMetadata:
        """`scheduled`: (request id, tokens computed once this step runs, each group's block ids
        or None to use the ids tracked from on_alloc/update_block_ids). `boundaries`: the Mamba
        states vLLM hands over this step, per request."""
        scheduled = list(scheduled)
        self._boundaries = boundaries or {}
        if scheduled and self.lazy is not None:
            self.lazy.drain.busy()
        try:  # a failure here (e.g. the NVMe index cannot be written) costs this step's stores only
            self.stores_finished(self.ctrl.expire())
            if self.store_enabled:
                if self.lazy is not None:
                    self.lazy.plan(self.max_blocks_per_step or (1 << 30))
                else:
                    self._plan_stores(scheduled)
        except Exception as e:  # noqa: BLE001
            self.count(Metric.STORE_PLAN_FAILED.key)
            self._once(("store_plan",) + cause(e), logging.ERROR,
                       "kvtier: planning this step's stores failed (%s: %s); they are skipped (future misses)",
                       type(e).__name__, e, exc_info=e)
        plan = self.ctrl.take_plan()
        meta = KVTierMetadata(loads=plan.loads, stores=plan.stores, copies=plan.copies,
                              shared_tier=self.ctrl.shared, tier_names=self.ctrl.names,
                              async_loads=self._async_step, failed_loads=self._failed_loads,
                              idle=not scheduled and bool(self._async_inflight),
                              model_identity=self.model_identity)
        self._async_step = []
        self._failed_loads = {}
        self._name_nvme(meta)
        meta.sending = self.holds.take_announce()
        meta.settle = self.reused.take()
        return meta

    def _name_nvme(self, meta: KVTierMetadata) -> None:
        if self.nvme_dir is not None:  # the worker opens the data plane from it (loads and stores)
            meta.nvme_tier = self.nvme
            meta.nvme_dir = self.nvme_dir
            meta.nvme_capacity = self.tiers[self.nvme].capacity_blocks

    # ---- failures: a failed hook's safe answer (`connector.hook`): no lease or pending slot is left
    # behind, loads vLLM accepted become load errors (recomputed) ------------------------------------
    def lookup_failed(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        self.release(request.request_id)
        return 0, False

    def alloc_failed(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.fail_alloc(request, block_ids_of(blocks), num_external_tokens)

    def meta_failed(self, scheduler_output: Any) -> KVTierMetadata:
        return self.fail_plan()

    def finish_failed(self, request: Any, block_ids: Any) -> tuple[bool, None]:
        self.release(request.request_id)
        return False, None

    def fail_alloc(self, request: Any, tables: Tables | None, num_external_tokens: int) -> None:
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
        ids = tables[0] if tables else None
        self._failed_loads[rid] = list(ids[first:first + nb]) if ids else []

    def fail_plan(self) -> KVTierMetadata:
        """`build_connector_meta` failed: send this step's loads as load errors (vLLM accepted them
        and must recompute them) and fail its stores and copies at once, so nothing stays pinned."""
        plan = self.ctrl.take_plan()
        failed = dict(self._failed_loads)
        for op in plan.loads:
            failed.setdefault(op.req_id, []).extend(op.block_ids)
        rep = KVTierWorkerMeta.of_plan(plan, ok=False, ranks=self.ctrl.reporters)  # every rank's, each failed
        waiting, self._failed_loads, self._async_step = self._async_step, {}, []
        self.on_worker_meta(rep)
        meta = KVTierMetadata(failed_loads=failed, async_loads=waiting, shared_tier=self.ctrl.shared,
                              tier_names=self.ctrl.names)
        self._name_nvme(meta)
        meta.sending = self.holds.take_announce()
        meta.settle = self.reused.take()
        return meta

    def update_block_ids(self, req_id: str, tables: Tables, replace: bool) -> None:
        """New block ids of every group (appended), or the whole tables (`replace`: resumed)."""
        r = self._reqs.get(req_id)
        if r is None:
            return
        if replace or not r.tables:
            r.tables = [list(t) for t in tables]
        else:
            for t, new in zip(r.tables, tables):
                t.extend(new)

    def _plan_stores(self, scheduled: Iterable[tuple[str, int, Tables | None]]) -> None:
        """Each group's blocks full once this step runs (a sliding window's too: vLLM drops them
        at the next step) and the Mamba states vLLM hands over."""
        for rid, computed_after, tables in scheduled:
            r = self._reqs.get(rid)
            if r is None:
                continue
            if tables is not None:
                r.tables = [list(t) for t in tables]
            self._track(r.request)
            pairs, first = self.rules.stores(r.request.block_hashes, computed_after, r.tables, r.done,
                                             self._boundaries.get(rid, ()))
            if pairs:
                keys = [k for k, _ in pairs]
                _, op_id, deferred = self.ctrl.store(keys, [b for _, b in pairs], self._info(r, first),
                                                     retry=self.rules.chain)
                self.holds.planned(rid, op_id)
                self._defer(r, first, keys, deferred)

    def _defer(self, r: _Req, first: int, keys: list[bytes], deferred: list[int]) -> None:
        """A chain's blocks the top tier found no room for now (every slot pinned: copies down
        still running, loads, promotions) are offered again in the request's next steps, while
        vLLM still holds them; those still unstored when it finishes are counted dropped then."""
        r.deferred = len(deferred)
        if deferred:
            gid = self.rules.groups[0].gid
            r.done[gid] = min(r.done[gid], r.keys.index(keys[deferred[0]], first))

    def has_pending_push_work(self) -> bool:
        """Lazy offload still has finished requests' blocks to write behind (connector/lazy_offload.py),
        or a finished request is held for its stores (`StoreHolds`)."""
        return self.lazy is not None and self.lazy.pending() or self.holds.pending()

    # ---- worker results ----------------------------------------------------------------
    def on_output(self, connector_output: Any) -> None:
        """vLLM's `KVConnectorOutput` of a step: the workers' report."""
        if self.recorder is not None:
            self.recorder.step_done()
        wm = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(wm, KVTierWorkerMeta):
            self.on_worker_meta(wm)
        self.holds.released(getattr(connector_output, "finished_sending", None) or ())

    def on_worker_meta(self, wm: KVTierWorkerMeta | None) -> None:
        if wm is None:
            return
        self._async_inflight.difference_update(wm.loaded)
        for rid, ok in wm.loaded.items():  # a failed load: vLLM recomputes those blocks; offer them again
            r = self._reqs.get(rid)
            if not ok and r is not None:
                self.rules.offer_again(r.done, r.load_start * self.block_tokens)
        self.stores_finished(self.ctrl.complete(wm))

    def stores_finished(self, done: dict[int, list[bool]]) -> None:
        """Store ops every rank reported (or aborted): their lazy-offload pins and the holds on
        their requests go now, never while a rank may still be copying."""
        if self.lazy is not None:
            for op_id, oks in done.items():
                self.lazy.on_stored(op_id, oks)
        self.holds.reported(done)

    # ---- end of a request --------------------------------------------------------------
    def on_finished(self, req_id: str, tables: Tables | None = None) -> tuple[bool, dict | None]:
        """(delay freeing its GPU blocks, params): delayed while an asynchronous load still writes
        them (vLLM frees them when the workers report the load received), or while its stores are
        unreported (`hold_stores`: freed when the workers report it sent). Lazy offload queues its
        full blocks (`tables`, each group's block ids) to be written behind."""
        self.lora.finished(req_id)
        r = self._reqs.pop(req_id, None)
        if r is not None and r.deferred:   # no room for them before vLLM frees them
            self.ctrl.count_dropped(0, r.deferred)
        if r is not None and tables and tables[0] and self.store_enabled and self.lazy is not None:
            self._track(r.request)
            self.lazy.write_behind(r.keys, tables[0])
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
        return self.holds.finish(req_id), None   # held while its stores still copy: finished_sending frees it

    def release(self, req_id: str) -> None:
        """The request's lease goes (a failed hook's safe answer)."""
        self.ctrl.release(req_id)

    def preempted(self, req_ids: Iterable[str]) -> None:
        """vLLM preempted these requests and freed their blocks (no hook of their own): the workers
        settle the stores still reading them (`ReusedBlocks`) before the step's forward."""
        for rid in req_ids:
            r = self._reqs.get(rid)
            if r is not None:
                self.reused.add(r.tables)
            self.on_preempted(rid)

    def on_preempted(self, req_id: str) -> None:
        self.ctrl.release(req_id)
        r = self._reqs.get(req_id)
        if r is not None:
            r.tables = []

    # ---- introspection -----------------------------------------------------------------
    def pinned_blocks(self) -> int:
        return self.ctrl.pinned_blocks()

    def leased_blocks(self) -> int:
        return int(self.ctrl.leases.pinned())

    def tenant_gauges(self) -> dict:
        """Bytes each tenant holds per tier (`kvtier.core.tenants`); empty without tenants."""
        return self.ctrl.tenants.gauges() if self.ctrl.tenants is not None else {}

    def stats(self) -> dict:
        d = self.ctrl.stats()
        d.update({"gpu_pinned": self.lazy.gpu_pinned if self.lazy is not None else 0, "offload": self.offload,
                  "pending_nvme_writes": d["pending_copies"]})
        return d

    def bind_gpu(self, ctx: Any, hashed: bool = True) -> None:
        """vLLM's GPU block pool (`kvtier.tiers.gpu`): what vLLM hashes the requests' blocks by;
        lazy offload walks its free queue for hashed blocks (it needs vLLM's prefix caching)."""
        hash_tokens = getattr(getattr(ctx, "pool", None), "hash_block_size", None)
        if hash_tokens:
            self.rules.hash_every(hash_tokens)
        if self.options.offload != "lazy":
            return
        if not self.rules.chain:
            log.warning("kvtier: offload 'lazy' stores what vLLM keeps cached, which has no sliding-window "
                        "block: with %d KV-cache groups blocks are stored eagerly", len(self.rules.groups))
        elif not hashed:
            log.warning("kvtier: offload 'lazy' needs prefix caching (hashed blocks in the GPU free "
                        "queue); it is off, so blocks are stored eagerly")
        else:
            self.offload = "lazy"
            self.lazy = LazyOffload(self.ctrl, ctx, self.count)

    def open_tier(self, t: int, tier: SlotTier) -> None:
        """A persistent tier opened after start (`TierController.open_tier`)."""
        self.ctrl.open_tier(t, tier)
        if t == self.nvme:
            self.nvme_dir = tier.dir

    def persistent_open(self, model_identity: str) -> None:
        """The persistent tiers are open under `model_identity`: the workers are told from the next step."""
        self.model_identity = model_identity

    def nvme_tiers(self) -> list[SlotTier]:
        """The open NVMe tiers (a tier closed until the model's identity is known has no directory)."""
        return [t for t in self.tiers if t.medium is Medium.FILE and t.ready]

    def drain_within(self, seconds: float) -> None:
        """SIGTERM: lazy offload writes behind for at most `seconds` more (called from a signal handler)."""
        if self.lazy is not None:
            self.lazy.drain.stop_in(seconds)

    def report_shutdown(self) -> None:
        """At shutdown, once the workers' last reports are in: what lazy offload left unwritten."""
        if self.lazy is not None:
            self.lazy.report_shutdown()

    def close(self) -> None:
        """The trace, then the NVMe index and its directory lock."""
        if self.recorder is not None:
            self.recorder.close()
        self.ctrl.close()


# ---- LoRA requests pass through ----------------------------------------------------------------------
class LoraGate:
    """Requests with a LoRA adapter pass through kvtier: never looked up, never stored.

    vLLM's block hashes name a request's adapter by its name and path, not by its weights, and the
    fingerprint names the base model only: an adapter rewritten in place with other weights, in this
    process or after a restart, would be served KV its weights never made. So such a request's KV
    stays in vLLM's own prefix cache; kvtier counts it (`lora_passthrough`, once per request) and
    says so in one line, once."""

    def __init__(self, count: Callable[[str], None]) -> None:
        self._count = count
        self._seen: set[str] = set()
        self._once = Once(log)

    def passes_through(self, request: Any) -> bool:
        """True for a request with a LoRA adapter (counted at its first sight)."""
        lora = getattr(request, "lora_request", None)
        if lora is None:
            return False
        rid = request.request_id
        if rid not in self._seen:
            self._seen.add(rid)
            self._count(Metric.LORA_PASSTHROUGH.key)
            self._once(("lora",), logging.WARNING, "kvtier: requests with a LoRA adapter (first: %s, adapter %r) "
                       "pass through: their KV is neither looked up nor stored in kvtier's tiers",
                       rid, getattr(lora, "lora_name", lora))
        return True

    def finished(self, req_id: str) -> None:
        self._seen.discard(req_id)


# ---- the persistent tiers open once the model's identity is known ------------------------------------
# The persistent tiers' (NVMe, shared) blocks are keyed by the fingerprint, which names the model
# by the digest of its whole weights (`identity.ModelIdentity`, a thread). At start the scheduler waits up to
# `WAIT_S` for it (a digest from the cache, or small weights, is done by then); otherwise the
# persistent tiers are built closed (`tiers.closed.ClosedTier`: lookups miss, copies into them are
# skipped and counted as `not_open_blocks.<tier>`; the DRAM tier serves) and `poll`, called from the
# scheduler's hooks, opens them under the full fingerprint at the first step after the digest is
# done, with one log line giving the time it took and its GB/s.

WAIT_S = 1.0
CLOSED_WHY = "until the weights' digest is done"


class PersistentTiers:
    """Builds the scheduler's tiers and opens the closed ones when `identity` is known.
    `fingerprint_of(model identity)`: the full fingerprint."""

    def __init__(self, cfg: Any, identity: ModelIdentity, fingerprint_of: Callable[[str | None], dict],
                 ranks: int = 1, wait_s: float = WAIT_S, part_bytes: int | None = None) -> None:
        """`ranks`: the parts of a stored block; `part_bytes`: one part's bytes."""
        self.cfg = cfg
        self.identity = identity
        self.fingerprint_of = fingerprint_of
        self.ranks = ranks
        self.part_bytes = part_bytes
        self.t0 = time.monotonic()
        identity.done.wait(wait_s)
        self.closed: list[int] = []          # indices of the tiers still closed
        self.failed = False

    def build(self) -> list[Any]:
        """The tiers: all open when the identity is known now, else the persistent ones closed."""
        if self.identity.value is not None:
            return build_tiers(self.cfg, "control", self.fingerprint_of(self.identity.value), ranks=self.ranks,
                               part_bytes=self.part_bytes)
        tiers = build_tiers(self.cfg, "control", self.fingerprint_of(None), ranks=self.ranks, closed=CLOSED_WHY,
                            part_bytes=self.part_bytes)
        self.closed = [i for i, t in enumerate(tiers) if not t.ready]
        return tiers

    def poll(self, sched: Any) -> bool:
        """Open the closed tiers once the digest is done (the scheduler's thread); True when it did."""
        if not self.closed or self.failed or not self.identity.done.is_set():
            return False
        ident = self.identity
        if ident.value is None:
            self.failed = True   # identity.py logged why; they stay closed
            sched.count(Metric.IDENTITY_UNKNOWN.key)
            return False
        fp = self.fingerprint_of(ident.value)
        opened = []
        try:
            for i in self.closed:
                tier = build_tier(self.cfg, i, "control", fp, self.ranks, part_bytes=self.part_bytes)
                sched.open_tier(i, tier)
                opened.append(tier.summary())
        except Exception as e:  # noqa: BLE001 - a directory in use, another fingerprint, ...
            self.failed = True
            sched.count(Metric.PERSISTENT_OPEN_FAILED.key)
            log.error("kvtier: persistent tiers stay closed: opening them failed (%s: %s)", type(e).__name__,
                      redact(str(e)))
            return False
        self.closed = []
        sched.persistent_open(fp["model"])
        log.info("kvtier: persistent tiers open %.1f s after start: %s; model %s (%s)",
                 time.monotonic() - self.t0, "; ".join(opened), ident.value, ident.how)
        return True


# ---- finished requests held for their stores (vLLM's delay-free protocol) ---------------------------
# On a GPU a store's copies run after `wait_for_save` returned (`worker.PendingStores`). A
# request that finishes while a store of its blocks is still unreported is held: `request_finished`
# returns delay_free=True, so vLLM keeps its blocks, and the next step's metadata names it with
# those stores (`KVTierMetadata.sending`). Each worker reports it in `finished_sending` once, in
# the first `get_finished` where none of those stores is still copying on that worker (completed,
# failed, or dropped at shutdown), or after `HOLD_LIMIT_S` (counted: `held_release_timeouts`).
# vLLM frees the blocks once every worker reported it (`KVOutputAggregator`, world size: every rank
# reports, a rank with nothing copying at once). The CPU backend copies in the hook: never held.
class StoreHolds:
    """Scheduler side: each request's store ops not yet reported, and the requests held for them."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled                    # stores complete in a later step (a GPU)
        self.ops: dict[str, set[int]] = {}        # request -> store ops planned, not reported
        self.of_op: dict[int, str] = {}
        self.announce: dict[str, list[int]] = {}  # held, to be named in the next step's metadata
        self.held: dict[str, float] = {}          # held until vLLM's finished_sending names it

    def planned(self, req_id: str, op_id: int) -> None:
        if self.enabled and op_id:
            self.ops.setdefault(req_id, set()).add(op_id)
            self.of_op[op_id] = req_id

    def reported(self, op_ids: Iterable[int]) -> None:
        """Stores every rank reported (stored or failed, `TierController.complete`), or aborted: no
        longer a reason to hold."""
        for op in op_ids:
            rid = self.of_op.pop(op, None)
            ops = self.ops.get(rid) if rid is not None else None
            if ops is not None:
                ops.discard(op)
                if not ops:
                    del self.ops[rid]

    def finish(self, req_id: str) -> bool:
        """`req_id` finished: held (True) when some of its stores are not reported yet."""
        ops = self.ops.pop(req_id, None)
        if not ops:
            return False
        for op in ops:
            self.of_op.pop(op, None)
        self.announce[req_id] = sorted(ops)
        self.held[req_id] = time.monotonic()
        return True

    def take_announce(self) -> dict[str, list[int]]:
        out, self.announce = self.announce, {}
        return out

    def released(self, req_ids: Iterable[str]) -> None:
        for rid in req_ids:
            self.held.pop(rid, None)

    def pending(self) -> bool:
        """A request held (within twice the workers' bound): vLLM keeps stepping to release it."""
        now = time.monotonic()
        return any(now - t < 2 * HOLD_LIMIT_S for t in self.held.values())


# ---- blocks vLLM may rewrite while a store still reads them ------------------------------------------
class ReusedBlocks:
    """Scheduler side: the GPU blocks vLLM may rewrite from this step on while a store queued in an
    earlier step may still be copying them: a preempted request's blocks (vLLM freed them with no
    hook) and every block vLLM allocated this step (how a block freed under a store comes back: a
    preempted or aborted request's, a sliding window's, a held request released at the bound,
    one lazy offload unpinned), vLLM's offloading scheduler's rule. Named in the step's metadata
    (`settle`): each worker waits for its stores reading them in `handle_preemptions`, before the
    forward or another connector writes them. Only when stores complete in a later step (a GPU):
    the CPU backend's complete in the hook. The null block (0) is never written."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.blocks: set[int] = set()

    def add(self, tables: Tables | None) -> None:
        if self.enabled and tables:
            for t in tables:
                self.blocks.update(b for b in t or () if b)

    def take(self) -> list[int]:
        out = sorted(self.blocks)
        self.blocks = set()
        return out
