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
served and how one hit covers them all.
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import TYPE_CHECKING, Any, Callable

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole, KVConnectorTransferResults, SupportsHMA)

from kvtier.common.counters import Metric
from kvtier.common.once import Once, cause
from kvtier.core.config import ConfigError
from kvtier.tiers.contract import Medium
from kvtier.tiers.redact import redact

from . import start_check
from .metadata import KVTierMetadata, KVTierStats, KVTierWorkerMeta, block_ids_of
from .shutdown import close_scheduler, close_worker
from .sides import (block_parts, fingerprint, kv_shape, model_identity, scheduler_side, settings, start_scheduler_side,
                    worker_side)
from .startup import attach_vllm_log_handler, register_by_name, scheduler_line, worker_line
from .metrics import SchedulerStats, connector_stats, prom_metrics, worker_stats

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

    from .metrics import KVTierPromMetrics

log = logging.getLogger("kvtier.connector")

_LIVE: "weakref.WeakSet[KVTierConnector]" = weakref.WeakSet()


def live_connectors(role: str | None = None) -> list["KVTierConnector"]:
    """Connector objects alive and not shut down in this process (tests, diagnostics); role 'scheduler'/'worker'."""
    out = [c for c in list(_LIVE) if not c.closed]
    if role is not None:
        out = [c for c in out if c.role_name == role]
    return out


def hook(recover: str | None = None, default: Any = None, refuse: tuple = (), name: str | None = None) -> Callable:
    """Decorate a connector hook: no exception leaves it. vLLM runs the hooks inside its engine
    loop, where an exception kills the engine; kvtier is a cache, so every failure has a safe
    answer (a lookup finds nothing, a load that cannot run is a load error vLLM recomputes, a store
    that cannot run is dropped). On an exception the failure is counted (`hook_errors.<hook>`) and
    logged once per hook and cause (`hook_failed`), then the hook answers `self.side.<recover>(*args)`
    (the scheduler's or the worker's safe answer, from its own state) or `default`. Exceptions of
    the `refuse` types pass through (a start-up that must not go on)."""
    def deco(fn: Callable) -> Callable:
        called = name or fn.__name__

        @functools.wraps(fn)
        def wrapper(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(self, *args, **kwargs)
            except refuse:
                raise
            except Exception as e:  # noqa: BLE001 - the engine must survive any failure of ours
                side = self.side
                hook_failed(side.count, self.failures_once, called, e)
                if recover is None:
                    return default() if callable(default) else default
                try:
                    return getattr(side, recover)(*args, **kwargs)
                except Exception as e2:  # noqa: BLE001
                    hook_failed(side.count, self.failures_once, called + ".recover", e2)
                    return default() if callable(default) else default
        return wrapper
    return deco


def hook_failed(count: Callable[..., None], once: Once, name: str, e: BaseException) -> None:
    """A hook's failure: counted (`hook_errors.<name>`), logged once per hook and cause."""
    count(Metric.HOOK_ERRORS.at(name))
    once(("hook", name) + cause(e), logging.ERROR,
         "kvtier: %s failed (%s: %s); answered as a miss / recompute, vLLM keeps serving "
         "(counted in hook_errors; later failures of this kind are logged at DEBUG)",
         name, type(e).__name__, redact(str(e)), exc_info=e)


def _worker_pool() -> int | None:
    """This process's worker CPU pool size, when a worker side lives here (the scheduler's cpu share)."""
    pools = [c.worker.pools[0].num_slots for c in live_connectors("worker") if c.worker and c.worker.pools]
    return pools[0] if pools else None


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's hooks, each forwarded to the scheduler side (`sched`, connector/scheduler.py) or a
    worker's (`worker`, connector/worker.py); a failure is answered by that side's safe answer
    (`hook`). The class methods vLLM calls before any connector is built forward to
    connector/start_check.py, the stats ones to connector/metrics.py."""

    failures_once = Once(log)   # a hook's failure: one line per hook and cause in this process

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
        self.parts = parts = block_parts(cfg, vllm_config, kv_cache_config, shape)
        self.fingerprint = fingerprint(cfg, vllm_config, shape, self.identity.value, parts)
        self.sched = self.worker = self.persistent = self.recorder = self.gpu_ctx = self.sched_stats = None
        self.closed = False
        if on_scheduler:
            self.persistent, self.recorder, self.sched = scheduler_side(
                cfg, vllm_config, kv_cache_config, shape, self.identity,
                lambda m: fingerprint(cfg, vllm_config, shape, m, parts), parts)
            self.sched_stats = SchedulerStats(self.sched, self.recorder, cfg, self.block_tokens, self.fingerprint)
        else:
            self.worker = worker_side(cfg, vllm_config, kv_cache_config, shape, self.fingerprint, parts)
        _LIVE.add(self)
        if self.sched is not None:
            start_scheduler_side(self.sched, vllm_config, cfg)
            log.info("%s", scheduler_line(self))
            self.sched_stats.publish(force=True)   # the state for `kvtier inspect --server`, then a heartbeat

    @property
    def requires_kv_delivery(self) -> bool:
        return False

    @property
    def side(self) -> Any:
        """The side this connector runs: what a failed hook counts into and answers from (`hook`)."""
        return self.sched if self.sched is not None else self.worker

    # ---- class methods: before any connector object is built ---------------------------
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.33's sleep mode: no (`start_check.supports_sleep_mode`: the workers hold views
        into the KV cache wake-up remaps)."""
        return start_check.supports_sleep_mode()

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return start_check.requires_piecewise_for_cudagraph(extra_config)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> str | None:
        return start_check.required_kvcache_layout(vllm_config)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVTierStats | None:
        return connector_stats(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> "KVTierPromMetrics":
        return prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ==============================================================================
    # Worker side
    # ==============================================================================
    @hook(recover="register_failed", refuse=(ConfigError,))
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

    @hook(recover="preemptions_failed")
    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before the step's forward and loads: stores still reading blocks vLLM hands out again
        (a preempted request's, any allocated this step) complete first (`KVTierWorker.handle_preemptions`)."""
        if self.worker is not None:
            self.worker.handle_preemptions(kv_connector_metadata)

    @hook(recover="load_failed")
    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        if self.worker is not None:
            self.worker.start_load()

    @hook(recover="layer_wait_failed")
    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.worker is not None:
            self.worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        return

    @hook(recover="save_failed")
    def wait_for_save(self) -> None:
        if self.worker is not None:
            self.worker.save()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Asynchronous loads: received once their blocks are in the KV; a failed one fails its
        request with several groups (a hybrid model: no block-level errors), else its blocks are
        load errors (`get_block_ids_with_load_errors`). Sent: finished requests held for their
        stores (`scheduler.StoreHolds`, `worker.SendingRequests`)."""
        out = self._transfer_results(finished_req_ids)
        if not self.hybrid:
            out.failed_recving = set()
        return out

    @hook(recover="transfers_failed", default=KVConnectorTransferResults, name="get_transfer_results")
    def _transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        out = KVConnectorTransferResults()
        if self.worker is not None:
            out.finished_recving = self.worker.poll_async()
            out.failed_recving = self.worker.take_failed_recving() & out.finished_recving
            out.finished_sending = self.worker.finished_sending()  # last: a failure before keeps them held
        return out

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors = self._load_errors()
        return set() if self.hybrid else errors  # hybrid: reported per request (get_transfer_results)

    @hook(recover="load_errors_failed", name="get_block_ids_with_load_errors")
    def _load_errors(self) -> set[int]:
        return self.worker.take_load_errors() if self.worker is not None else set()

    @hook(recover="worker_meta_failed")
    def build_connector_worker_meta(self) -> KVTierWorkerMeta | None:
        return self.worker.take_report() if self.worker is not None else None

    @hook()
    def shutdown(self) -> None:
        """vLLM's shutdown: the executor's workers first, then the scheduler (connector/shutdown.py)."""
        if self.closed:
            return
        self.closed = True
        if self.worker is not None:
            close_worker(self.worker, [c.sched for c in live_connectors("scheduler") if c.sched is not None])
        if self.sched is not None:
            self.sched_stats.close()
            close_scheduler(self.sched, self.sched_stats)

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

    @hook(recover="lookup_failed")
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.sched is None or not self.enabled:
            return 0, False
        self.persistent.poll(self.sched)
        n = self.sched.lookup(request, num_computed_tokens)
        return n, bool(n) and self.sched.loads_async(request.request_id)

    @hook(recover="alloc_failed")
    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        if self.sched is not None and self.enabled:
            self.sched.on_alloc(request, block_ids_of(blocks), num_external_tokens)

    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int) -> dict:
        by = self._hit_sources(request, num_external_tokens)
        return by if by is not None else super().get_external_cache_hit_sources(request, num_external_tokens)

    @hook(name="get_external_cache_hit_sources")
    def _hit_sources(self, request: "Request", num_external_tokens: int) -> dict | None:
        """The hit's tokens by medium; None (and on a failure): vLLM's default answer."""
        if num_external_tokens == 0 or CacheHitSource is None or self.sched is None:
            return None
        return hit_sources(self.sched.hit_sources(request.request_id), num_external_tokens)

    @hook(recover="meta_failed")
    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        if self.sched is None or not self.enabled:
            return KVTierMetadata()
        self.persistent.poll(self.sched)
        return self.sched.on_step(scheduler_output)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        if self.sched is not None:
            self.sched.on_output(connector_output)

    @hook(recover="finish_failed")
    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self.sched is None:
            return False, None
        return self.sched.on_finished(request.request_id, (block_ids,))

    @hook(recover="finish_failed")
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

    @hook()
    def get_kv_connector_stats(self) -> KVTierStats | None:
        """This step's counters (vLLM calls it once per step on each side; connector/metrics.py)."""
        if self.worker is not None:
            return worker_stats(self.worker)
        return self.sched_stats.interval() if self.sched is not None else None

    # ---- introspection -----------------------------------------------------------------
    def stats(self) -> dict:
        part = self.sched if self.sched is not None else self.worker
        d = {"role": self.role_name, "enabled": self.enabled}
        if part is not None:
            d.update(part.stats())
        return d


def hit_sources(by: dict, num_external_tokens: int) -> dict:
    """A hit's tokens by medium as vLLM's `CacheHitSource`s; all under HOST when they do not add
    up to what vLLM accepted."""
    source = {Medium.HOST: CacheHitSource.HOST, Medium.FILE: CacheHitSource.DISK,
              Medium.SHARED: CacheHitSource.EXTERNAL_UNSPECIFIED}
    out: dict = {}
    for medium, n in by.items():
        out[source[medium]] = out.get(source[medium], 0) + n
    if sum(out.values()) != num_external_tokens:
        return {CacheHitSource.HOST: num_external_tokens}
    return out


register_by_name("KVTierConnector", __name__)
