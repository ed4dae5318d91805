"""`KVTierConnector`: kvtier's tier stack mounted in vLLM as one KV connector.

Load with::

    KVTransferConfig(kv_connector="KVTierConnector", kv_connector_module_path="kvtier.connector",
                     kv_role="kv_both", kv_connector_extra_config={"config": "cpu.yaml"})

A cache-style connector: `requires_kv_delivery` is False (a dropped store is a future miss).
Local loads are synchronous; shared-tier loads, and every load of a hybrid model, are
asynchronous (the request waits, the step does not). A failed load is recomputed: per block
(`get_block_ids_with_load_errors`) with one KV-cache group, per request (`failed_recving`)
with several, as vLLM requires.

`SupportsHMA`: hybrid models (sliding window, Mamba / linear attention, several attention
groups) keep vLLM's hybrid KV-cache manager; connector/groups.py says which group kinds are
served, connector/hybrid.py how one hit covers them all.
"""

from __future__ import annotations

import logging
import math
import time
import weakref
from typing import TYPE_CHECKING, Any

import torch
import xxhash

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole, KVConnectorTransferResults, SupportsHMA)

from kvtier.core.builder import build_controller, tier_sealer
from kvtier.core.config import ConfigError
from kvtier.tiers.once import Once
from kvtier.tiers.contract import Medium

from .config import load_settings, tier_of
from .drain import drain_at_sigterm
from .groups import GroupKind, block_geometry, served_groups
from .guard import SafeAnswers, hook
from .handoff import clear_reports, read_reports, write_report
from .hybrid import HybridRules
from kvtier.core.digest_cache import data_dir_of
from kvtier.core.identity import ModelIdentity
from .kv_layout import layout_name
from .metadata import KVTierMetadata, KVTierWorkerMeta, block_ids_of, group0_ids
from .parallel import shards, store_rank
from .persistent import PersistentTiers
from .scheduler import KVTierScheduler
from .startup import (attach_vllm_log_handler, flush_budget_s, register_by_name, remote_opener, scheduler_line,
                      short_totals, warn_per_process_hashes, worker_line)
from .start_check import StartChecks
from .stats_hooks import StatsHooks
from .worker import SHUTDOWN_FLUSH_TIMEOUT_S, KVTierWorker

try:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except Exception:  # pragma: no cover - older vLLM
    CacheHitSource = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvtier.connector")

_LIVE: "weakref.WeakSet[KVTierConnector]" = weakref.WeakSet()


def live_connectors(role: str | None = None) -> list["KVTierConnector"]:
    """Connector objects alive and not shut down in this process (tests, diagnostics); role 'scheduler'/'worker'."""
    out = [c for c in list(_LIVE) if not c.closed]
    if role is not None:
        out = [c for c in out if c.role_name == role]
    return out


def _world_size(vllm_config: Any) -> int:
    """Workers holding a shard of every block (tensor x pipeline parallel)."""
    return int(getattr(getattr(vllm_config, "parallel_config", None), "world_size", 1) or 1)


def _drops_draft_block(vllm_config: Any) -> bool:
    """Speculative decoding whose draft's trailing block a hit drops (EAGLE / MTP)."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return False
    drop = getattr(spec, "use_eagle_block_drop", None) or spec.use_eagle   # vLLM 0.32 / earlier name
    return bool(drop())


class KVTierConnector(SafeAnswers, StatsHooks, StartChecks, KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        attach_vllm_log_handler()
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        cfg = load_settings(extra)
        self.role_name = "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"
        bb, block_tokens = block_geometry(kv_cache_config)
        self.block_tokens = block_tokens or vllm_config.cache_config.block_size
        self.block_bytes_estimate = bb
        self.groups, why = served_groups(kv_cache_config, _drops_draft_block(vllm_config))
        # the group rules (connector/hybrid.py) serve several groups, a window, a state, a draft's block
        self.hybrid = len(self.groups) > 1 or any(g.kind is not GroupKind.FULL or g.eagle for g in self.groups)
        self.enabled = bb > 0 and why is None
        if not self.enabled:
            log.warning("kvtier: connector disabled: %s", why or f"block of {bb} bytes")
        # the block is vLLM's: the YAML's capacities in bytes are counted in these blocks
        cfg = cfg.model_copy(update={"block_bytes": bb or 1, "block_tokens": self.block_tokens})
        if role == KVConnectorRole.SCHEDULER and self.enabled:
            cfg = self._fit_scheduler(cfg)
        self.config = cfg
        self.identity = ModelIdentity(str(vllm_config.model_config.model), vllm_config.model_config.revision,
                                      cfg.serving.model_identity, data_dir_of(cfg.serving.data_dir),
                                      start=role == KVConnectorRole.SCHEDULER and self.enabled)
        self.fingerprint = self._fingerprint(vllm_config, self.identity.value)
        cpu = tier_of(cfg, "cpu")
        nvme = tier_of(cfg, "nvme")
        self.sched: KVTierScheduler | None = None
        self.worker: KVTierWorker | None = None
        self.gpu_ctx = None
        self.closed = False
        self._last_gauges: dict[str, float] = {}
        self._once = Once(log)
        self._stats_at = float("-inf")
        policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute")
        if policy != "recompute" and role == KVConnectorRole.SCHEDULER:
            log.warning("kvtier: kv_load_failure_policy=%r: a block kvtier fails to load (I/O error, "
                        "checksum mismatch) fails its request; set 'recompute' to recompute it", policy)
        shared = tier_of(cfg, "redis")
        if role == KVConnectorRole.SCHEDULER:
            ranks = shards(vllm_config, kv_cache_config)
            self.persistent = PersistentTiers(cfg, self.identity, lambda m: self._fingerprint(vllm_config, m),
                                              ranks) if self.enabled else None
            tiers = self.persistent.build() if self.persistent is not None else []
            ctrl = build_controller(cfg, tiers, ranks=ranks)
            # MTP with several modules re-prefills its last lookahead tokens: not final until then
            reprefill = max(0, int(getattr(vllm_config, "num_prefill_lookahead_tokens", 0) or 0) - 1)
            hybrid = HybridRules(self.groups, math.gcd(*[g.block_tokens for g in self.groups]), reprefill) \
                if self.hybrid else None
            self.sched = KVTierScheduler(block_tokens=self.block_tokens, group_id=0,
                                         store=cfg.serving.store and self.enabled, offload="eager",
                                         max_blocks_per_step=cfg.serving.max_blocks_per_step, controller=ctrl,
                                         async_shared_loads=cfg.serving.async_shared_loads and not self.hybrid,
                                         hybrid=hybrid)
            self.sched.model_identity = self.identity.value
        else:
            rank = int(getattr(getattr(vllm_config, "parallel_config", None), "rank", 0) or 0)
            srank = store_rank(vllm_config, rank, kv_cache_config)
            self.worker = KVTierWorker(None, cpu_tier=cpu, pin=cpu.pin if cpu is not None else "auto",
                                       nvme_io=nvme.io if nvme else "auto",
                                       nvme_io_threads=nvme.io_threads if nvme else 4,
                                       nvme_direct=nvme.direct if nvme else "auto", nvme_sealer=tier_sealer(cfg, nvme),
                                       nvme_write_lag_steps=cfg.serving.nvme_write_lag_steps, rank=rank,
                                       ranks=_world_size(vllm_config), expected_block_bytes=bb or None,
                                       num_blocks=getattr(kv_cache_config, "num_blocks", None),
                                       store_rank=srank, remote_needs_identity=True,
                                       remote_fn=remote_opener(shared, self.fingerprint, srank) if shared else None)
        _LIVE.add(self)
        if self.sched is not None:  # SIGTERM: lazy offload writes behind within vLLM's shutdown timeout
            me = weakref.ref(self)
            drain_at_sigterm(lambda: getattr(me(), "sched", None), getattr(vllm_config, "shutdown_timeout", 0),
                             flush_budget_s(SHUTDOWN_FLUSH_TIMEOUT_S))
        if self.sched is not None and shared is not None:
            warn_per_process_hashes(vllm_config)
        if self.sched is not None and cfg.serving.record_trace and self.enabled:
            from .recorder import TraceRecorder, served_geometry
            self.sched.recorder = TraceRecorder(cfg.serving.record_trace, self.block_tokens,
                                                cfg.serving.record_max_bytes, count=self.sched._count,
                                                geometry=served_geometry(self.fingerprint, self.block_bytes_estimate))
        if self.sched is not None:
            for t in self._nvme_tiers():
                if clear_reports(t.dir):
                    log.warning("kvtier: %s: dropped a shutdown report an earlier run left unread", t.dir)
            log.info("%s", scheduler_line(self))
            self._publish_stats(force=True)   # the state for `kvtier inspect --server`, then a heartbeat

    @staticmethod
    def _fit_scheduler(cfg: Any) -> Any:
        """Scheduler-side sizes: an nvme tier that does not fit its disk is refused (ConfigError); a cpu
        share takes this process's worker pool size, else is resolved here and follows the workers' reports."""
        from kvtier.core.fit import fit_to_machine
        cfg, _ = fit_to_machine(cfg, kinds=("nvme",))
        cpu = tier_of(cfg, "cpu")
        if cpu is not None and cpu.share() is not None:
            pools = [c.worker.pools[0].num_slots for c in live_connectors("worker") if c.worker and c.worker.pools]
            if pools:
                tiers = [t.model_copy(update={"capacity": None, "capacity_blocks": pools[0]}) if t is cpu else t
                         for t in cfg.tiers]
                cfg = cfg.model_copy(update={"tiers": tiers})
            else:
                cfg, _ = fit_to_machine(cfg, kinds=("cpu",), check=False)
        return cfg

    def _fingerprint(self, vllm_config: Any, model: str | None) -> dict:
        """What must match for a stored block to be served: the model's identity, KV dtype, layout, parallelism."""
        mc, pc = vllm_config.model_config, vllm_config.parallel_config
        return self.config.fingerprint(
            model=model or "(not known yet)", revision=str(getattr(mc, "revision", None)),
            dtype=str(getattr(mc, "dtype", "?")),
            kv_cache_dtype=str(getattr(vllm_config.cache_config, "cache_dtype", "auto")),
            layout=self._layout_name(vllm_config), tp=int(getattr(pc, "tensor_parallel_size", 1)),
            pp=int(getattr(pc, "pipeline_parallel_size", 1)))

    def _layout_name(self, vllm_config: Any) -> str:
        """The blocks' byte format (`kv_layout.layout_name`), plus a digest of the groups when several:
        a block stored under another format or group layout is never served."""
        name = layout_name(str(getattr(getattr(vllm_config, "device_config", None), "device_type", "cuda")))
        if not self.hybrid:
            return name
        return name + ":groups-" + xxhash.xxh3_64_hexdigest(repr(self.groups).encode())

    @property
    def requires_kv_delivery(self) -> bool:
        return False

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.33's sleep mode: no. Wake-up remaps the KV cache the workers hold views into
        (connector/kv_layout.py); vLLM refuses `enable_sleep_mode` with kvtier mounted, not stale KV."""
        return False

    # ==============================================================================
    # Worker side
    # ==============================================================================
    @hook(recover="_register_failed", refuse=(ConfigError,))
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.worker is not None and self.enabled:
            self.worker.register_kv_caches(kv_caches)
            line, warnings = worker_line(self)
            log.info("%s", line)
            for w in warnings:
                log.warning("%s", w)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None:
            self.worker.bind(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self.worker is not None:
            self.worker.bind(None)

    @hook(recover="_load_failed")
    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        if self.worker is not None:
            self.worker.start_load()

    @hook(recover="_layer_wait_failed")
    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.worker is not None:
            self.worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        return

    @hook(recover="_save_failed")
    def wait_for_save(self) -> None:
        if self.worker is not None:
            self.worker.save()

    @hook(recover="_transfers_failed")
    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # Only asynchronous loads are delayed: received once their blocks are in the KV. A hybrid
        # model's failed load fails its request (no block-level errors with several groups).
        out = KVConnectorTransferResults()
        if self.worker is not None:
            out.finished_recving = self.worker.poll_async()
            failed = self.worker.take_failed_recving()
            if self.hybrid:
                out.failed_recving = failed & out.finished_recving
        return out

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    @hook(recover="_load_errors_failed")
    def get_block_ids_with_load_errors(self) -> set[int]:
        if self.worker is None:
            return set()
        errors = self.worker.take_load_errors()
        return set() if self.hybrid else errors  # hybrid: reported per request (get_transfer_results)

    @hook(recover="_worker_meta_failed")
    def build_connector_worker_meta(self) -> KVTierWorkerMeta | None:
        if self.worker is None:
            return None
        return self.worker.take_report()

    @hook()
    def shutdown(self) -> None:
        """vLLM's shutdown (SIGTERM / SIGINT of the server, LLM deleted): the executor's workers
        first, then the scheduler. The worker waits (bounded) for its pending NVMe write-back and
        hands the report no step carried to the scheduler: directly when it lives in this
        process, else through the NVMe directory (connector/handoff.py). The scheduler commits
        it, then closes the index and its directory lock."""
        if self.closed:
            return
        self.closed = True
        if self.worker is not None:
            nvme_dir = self.worker.nvme.dir if self.worker.nvme is not None else None
            final = self.worker.close(timeout_s=flush_budget_s(SHUTDOWN_FLUSH_TIMEOUT_S))
            if final is not None and final.copied:
                n = sum(1 for v in final.copied.values() for c in v if c >= 0)
                peers = [c for c in live_connectors("scheduler") if c.sched is not None]
                if peers:
                    peers[0].sched.on_worker_meta(final)
                    log.info("kvtier: shutdown: %d NVMe blocks written back after the last step, handed "
                             "to the scheduler", n)
                elif nvme_dir:
                    path = write_report(nvme_dir, final)
                    log.info("kvtier: shutdown: %d NVMe blocks written back after the last step; report "
                             "for the scheduler in %s", n, path)
                else:
                    log.warning("kvtier: shutdown: %d NVMe blocks written back after the last step and no "
                                "way to tell the scheduler: not indexed (misses after a restart)", n)
        if self.sched is not None:
            for t in self._nvme_tiers():  # the workers exited first: their last reports
                rep = read_reports(t.dir)
                if rep is not None:
                    self.sched.on_worker_meta(rep)
                    n = sum(1 for v in rep.written_by_rank().values() for c in next(iter(v.values()), []) if c >= 0)
                    log.info("kvtier: shutdown: workers' last write-back report read from %s: %d blocks", t.dir, n)
            if self.sched.lazy is not None:
                self.sched.lazy.report_shutdown()
            self._publish_stats(force=True, final=True)
            if self.sched.recorder is not None:
                self.sched.recorder.close()
            t0 = time.monotonic()
            self.sched.close()  # the NVMe index and its directory lock
            log.info("kvtier connector (scheduler): shut down, index closed in %.2f s; totals %s",
                     time.monotonic() - t0, short_totals(self.sched.totals))

    # ==============================================================================
    # Scheduler side
    # ==============================================================================
    @hook()
    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        from kvtier.tiers.gpu import BlockPoolContext
        self._bind_gpu(BlockPoolContext(gpu_block_pool), bool(getattr(gpu_block_pool, "enable_caching", True)))

    def bind_scheduler_context(self, ctx: Any) -> None:  # a future vLLM hook; take it as is
        self._bind_gpu(ctx, True)

    def _bind_gpu(self, ctx: Any, hashed: bool) -> None:
        """Lazy offload walks the GPU free queue for hashed blocks: it needs vLLM's prefix caching."""
        self.gpu_ctx = ctx
        if self.sched is None:
            return
        hash_tokens = getattr(getattr(ctx, "pool", None), "hash_block_size", None)
        if self.sched.hybrid is not None and hash_tokens:
            self.sched.hybrid.hash_tokens = int(hash_tokens)   # what vLLM hashes the requests' blocks by
        if self.config.policy.offload == "lazy":
            if self.sched.hybrid is not None:
                log.warning("kvtier: offload 'lazy' stores what vLLM keeps cached, which has no sliding-window "
                            "block: with %d KV-cache groups blocks are stored eagerly", len(self.groups))
            elif hashed:
                self.sched.offload = "lazy"
            else:
                log.warning("kvtier: offload 'lazy' needs prefix caching (hashed blocks in the GPU free "
                            "queue); it is off, so blocks are stored eagerly")
        self.sched.bind_gpu(ctx)

    @hook(recover="_lookup_failed")
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.sched is None or not self.enabled:
            return 0, False
        self.persistent.poll(self.sched)
        n = self.sched.lookup(request, num_computed_tokens)
        return n, bool(n) and self.sched.loads_async(request.request_id)

    @hook(recover="_alloc_failed")
    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        if self.sched is None or not self.enabled:
            return
        if self.hybrid:
            self.sched.on_alloc_groups(request, block_ids_of(blocks), num_external_tokens)
        else:
            self.sched.on_alloc(request, group0_ids(block_ids_of(blocks)), num_external_tokens)

    @hook(recover="_sources_failed")
    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int) -> dict:
        if num_external_tokens == 0 or CacheHitSource is None or self.sched is None:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        by = self.sched.hit_sources(request.request_id)
        out: dict = {}
        source = {Medium.HOST: CacheHitSource.HOST, Medium.FILE: CacheHitSource.DISK,
                  Medium.SHARED: CacheHitSource.EXTERNAL_UNSPECIFIED}
        for medium, n in by.items():
            out[source[medium]] = out.get(source[medium], 0) + n
        if sum(out.values()) != num_external_tokens:
            return {CacheHitSource.HOST: num_external_tokens}
        return out

    @hook(recover="_meta_failed")
    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        if self.sched is None or not self.enabled:
            return KVTierMetadata()
        self.persistent.poll(self.sched)
        so = scheduler_output
        if self.sched.recorder is not None:   # the prefill speed the trace states (plan's cost model)
            self.sched.recorder.scheduled(so)
        bstate = getattr(so, "kv_connector_block_state", None)
        if self.hybrid:
            return self._build_meta_groups(so, bstate)
        scheduled: list[tuple[str, int, list[int] | None]] = []
        nst = so.num_scheduled_tokens
        for nr in so.scheduled_new_reqs:
            ids = list(nr.block_ids[0]) if nr.block_ids else []
            self.sched.update_block_ids(nr.req_id, ids, replace=True)
            scheduled.append((nr.req_id, nr.num_computed_tokens + nst.get(nr.req_id, 0), None))
        cr = so.scheduled_cached_reqs
        resumed = getattr(cr, "resumed_req_ids", set()) or set()
        for i, rid in enumerate(cr.req_ids):
            nb = cr.new_block_ids[i]
            if nb is not None:
                self.sched.update_block_ids(rid, nb[0], replace=rid in resumed)
            elif rid in resumed:
                self.sched.update_block_ids(rid, [], replace=True)
            scheduled.append((rid, cr.num_computed_tokens[i] + nst.get(rid, 0), None))
        if bstate is not None:  # exact block tables when vLLM offers them (0.32+)
            scheduled = [(rid, n, group0_ids(bstate.get_block_ids(rid))) for rid, n, _ in scheduled]
        return self.sched.build_meta(scheduled)

    @hook()
    def _build_meta_groups(self, so: "SchedulerOutput", bstate: Any) -> KVConnectorMetadata:
        """A hybrid model: every group's block table (vLLM's exact tables when it offers them) and
        the Mamba states it hands over this step."""
        nst = so.num_scheduled_tokens
        scheduled: list[tuple[str, int, Any]] = []
        for nr in so.scheduled_new_reqs:
            self.sched.update_block_ids(nr.req_id, [], True, tables=nr.block_ids or ())
            scheduled.append((nr.req_id, nr.num_computed_tokens + nst.get(nr.req_id, 0), None))
        cr = so.scheduled_cached_reqs
        resumed = getattr(cr, "resumed_req_ids", set()) or set()
        for i, rid in enumerate(cr.req_ids):
            nb = cr.new_block_ids[i]
            if nb is not None or rid in resumed:
                self.sched.update_block_ids(rid, [], rid in resumed, tables=nb or ())
            scheduled.append((rid, cr.num_computed_tokens[i] + nst.get(rid, 0), None))
        boundaries = {}
        if bstate is not None:
            scheduled = [(rid, n, bstate.get_block_ids(rid)) for rid, n, _ in scheduled]
            boundaries = dict(getattr(bstate, "boundary_state_offloads", None) or {})
        return self.sched.build_meta(scheduled, boundaries)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        if self.sched is None:
            return
        if self.sched.recorder is not None:
            self.sched.recorder.step_done()
        wm = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(wm, KVTierWorkerMeta):
            self.sched.on_worker_meta(wm)

    @hook(recover="_finish_failed")
    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self.sched is None:
            return False, None
        return self.sched.on_finished(request.request_id, block_ids)

    @hook(recover="_finish_failed")
    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """`SupportsHMA`: vLLM calls this instead of `request_finished` (one list per group)."""
        if self.sched is None:
            return False, None
        return self.sched.on_finished(request.request_id, list(block_ids[0]) if block_ids and not self.hybrid
                                      else None)

    def has_pending_push_work(self) -> bool:
        """Lazy offload's write-behind keeps vLLM stepping after its last request (bounded)."""
        return self.sched is not None and self.enabled and self.sched.has_pending_push_work()

    # ---- introspection -----------------------------------------------------------------
    def stats(self) -> dict:
        part = self.sched if self.sched is not None else self.worker
        d = {"role": self.role_name, "enabled": self.enabled}
        if part is not None:
            d.update(part.stats())
        return d


register_by_name("KVTierConnector", __name__)
