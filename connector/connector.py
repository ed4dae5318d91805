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
import time
import weakref
from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole, KVConnectorTransferResults, SupportsHMA)

from kvtier.core.config import ConfigError
from kvtier.tiers.once import Once
from kvtier.tiers.contract import Medium

from .guard import SafeAnswers, hook
from .handoff import read_reports, write_report
from .metadata import KVTierMetadata, KVTierWorkerMeta, block_ids_of
from .sides import (fingerprint, kv_shape, model_identity, scheduler_side, settings, start_scheduler_side,
                    worker_side)
from .startup import attach_vllm_log_handler, flush_budget_s, register_by_name, scheduler_line, short_totals, worker_line
from .start_check import StartChecks
from .stats_hooks import StatsHooks
from .worker import SHUTDOWN_FLUSH_TIMEOUT_S

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


def _worker_pool() -> int | None:
    """This process's worker CPU pool size, when a worker side lives here (the scheduler's cpu share)."""
    pools = [c.worker.pools[0].num_slots for c in live_connectors("worker") if c.worker and c.worker.pools]
    return pools[0] if pools else None


class KVTierConnector(SafeAnswers, StatsHooks, StartChecks, KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        """Wiring only: the parts are built in connector/sides.py."""
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        attach_vllm_log_handler()
        on_scheduler = role == KVConnectorRole.SCHEDULER
        self.role_name = "scheduler" if on_scheduler else "worker"
        shape = kv_shape(vllm_config, kv_cache_config)
        self.groups, self.hybrid, self.enabled = shape.groups, shape.hybrid, shape.enabled
        self.block_tokens, self.block_bytes_estimate = shape.block_tokens, shape.block_bytes
        self.config = cfg = settings(self._kv_transfer_config.kv_connector_extra_config, shape, on_scheduler,
                                     _worker_pool() if on_scheduler else None)
        self.identity = model_identity(cfg, vllm_config, start=on_scheduler and self.enabled)
        self.fingerprint = fingerprint(cfg, vllm_config, shape, self.identity.value)
        self.sched = self.worker = self.persistent = self.recorder = self.gpu_ctx = None
        self.closed, self._last_gauges, self._once, self._stats_at = False, {}, Once(log), float("-inf")
        if on_scheduler:
            self.persistent, self.recorder, self.sched = scheduler_side(
                cfg, vllm_config, kv_cache_config, shape, self.identity,
                lambda m: fingerprint(cfg, vllm_config, shape, m))
        else:
            self.worker = worker_side(cfg, vllm_config, kv_cache_config, shape, self.fingerprint)
        _LIVE.add(self)
        if self.sched is not None:
            start_scheduler_side(self.sched, vllm_config, cfg)
            log.info("%s", scheduler_line(self))
            self._publish_stats(force=True)   # the state for `kvtier inspect --server`, then a heartbeat

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
        # Asynchronous loads: received once their blocks are in the KV. A hybrid model's failed load
        # fails its request (no block-level errors with several groups). Sent: finished requests
        # held for their stores (connector/held_requests.py).
        out = KVConnectorTransferResults()
        if self.worker is not None:
            out.finished_recving = self.worker.poll_async()
            failed = self.worker.take_failed_recving()
            if self.hybrid:
                out.failed_recving = failed & out.finished_recving
            out.finished_sending = self.worker.finished_sending()  # last: a failure before keeps them held
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
            for t in self.sched.nvme_tiers():  # the workers exited first: their last reports
                rep = read_reports(t.dir)
                if rep is not None:
                    self.sched.on_worker_meta(rep)
                    n = sum(1 for v in rep.written_by_rank().values() for c in next(iter(v.values()), []) if c >= 0)
                    log.info("kvtier: shutdown: workers' last write-back report read from %s: %d blocks", t.dir, n)
            self.sched.report_shutdown()
            self._publish_stats(force=True, final=True)
            t0 = time.monotonic()
            self.sched.close()  # the trace, the NVMe index and its directory lock
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
        self.gpu_ctx = ctx
        if self.sched is not None:
            self.sched.bind_gpu(ctx, hashed)

    @hook(recover="_lookup_failed")
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.sched is None or not self.enabled:
            return 0, False
        self.persistent.poll(self.sched)
        n = self.sched.lookup(request, num_computed_tokens)
        return n, bool(n) and self.sched.loads_async(request.request_id)

    @hook(recover="_alloc_failed")
    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        if self.sched is not None and self.enabled:
            self.sched.on_alloc(request, block_ids_of(blocks), num_external_tokens)

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
        return self.sched.on_step(scheduler_output)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        if self.sched is not None:
            self.sched.on_output(connector_output)

    @hook(recover="_finish_failed")
    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self.sched is None:
            return False, None
        return self.sched.on_finished(request.request_id, (block_ids,))

    @hook(recover="_finish_failed")
    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """`SupportsHMA`: vLLM calls this instead of `request_finished` (one list per group)."""
        if self.sched is None:
            return False, None
        return self.sched.on_finished(request.request_id, block_ids)

    def has_pending_push_work(self) -> bool:
        """Lazy offload's write-behind, or a finished request held for its stores, keeps vLLM
        stepping after its last request (bounded)."""
        return self.sched is not None and self.enabled and self.sched.has_pending_push_work()

    # ---- introspection -----------------------------------------------------------------
    def stats(self) -> dict:
        part = self.sched if self.sched is not None else self.worker
        d = {"role": self.role_name, "enabled": self.enabled}
        if part is not None:
            d.update(part.stats())
        return d


register_by_name("KVTierConnector", __name__)
