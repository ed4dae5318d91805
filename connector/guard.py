"""No exception leaves a vLLM hook.

vLLM runs the connector's hooks inside its engine loop: an exception there kills the engine
(EngineDeadError, every request fails, the server exits). kvtier is a cache, so every failure
has a safe answer: a lookup finds nothing, a load that cannot run is reported as a load error
(vLLM recomputes those blocks), a store that cannot run is dropped (a future miss). `hook`
wraps each hook with that answer; `kvtier.tiers.once.Once` keeps a failure that repeats (a full disk
fails every step) to one log line per cause while the counters count every one.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any, Callable

from kvtier.tiers.once import cause
from kvtier.tiers.redact import redact
from kvtier.tiers.counters import Metric

from .metadata import KVTierMetadata, KVTierWorkerMeta, block_ids_of

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorTransferResults
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvtier.connector")


def hook(recover: str | None = None, default: Any = None, refuse: tuple = ()) -> Callable:
    """Decorate a connector hook: on an exception, `self._hook_failed(name, e)` logs it (once per
    hook and cause) and counts it, then the hook answers `self.<recover>(*args)` or `default`.
    Exceptions of the `refuse` types pass through (a start-up that must not go on)."""
    def deco(fn: Callable) -> Callable:
        name = fn.__name__

        @functools.wraps(fn)
        def wrapper(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(self, *args, **kwargs)
            except refuse:
                raise
            except Exception as e:  # noqa: BLE001 - the engine must survive any failure of ours
                self._hook_failed(name, e)
                if recover is None:
                    return default() if callable(default) else default
                try:
                    return getattr(self, recover)(*args, **kwargs)
                except Exception as e2:  # noqa: BLE001
                    self._hook_failed(name + ".recover", e2)
                    return default() if callable(default) else default
        return wrapper
    return deco


class SafeAnswers:
    """What each hook of `KVTierConnector` answers when it failed (named by `hook(recover=...)`):
    a part of the connector, working on its own state (`sched`, `worker`, `_once`)."""

    def _hook_failed(self, name: str, e: BaseException) -> None:
        part = self.sched if self.sched is not None else self.worker
        if part is not None:
            part.count(Metric.HOOK_ERRORS.at(name))
        self._once(("hook", name) + cause(e), logging.ERROR,
                   "kvtier: %s failed (%s: %s); answered as a miss / recompute, vLLM keeps serving "
                   "(counted in hook_errors; later failures of this kind are logged at DEBUG)",
                   name, type(e).__name__, redact(str(e)), exc_info=e)

    def _register_failed(self, kv_caches: dict) -> None:
        log.error("kvtier: worker rank %s runs without kvtier: every planned load is recomputed, "
                  "nothing is stored", self.worker.rank if self.worker is not None else "?")
        if self.worker is not None:
            self.worker.disable()

    def _load_failed(self, *args: Any, **kwargs: Any) -> None:
        if self.worker is not None:
            self.worker.fail_step_loads()

    def _layer_wait_failed(self, layer_name: str) -> None:
        if self.worker is not None:  # never an early return: the host waits, or the loads fail
            self.worker.settle_loads()

    def _save_failed(self) -> None:
        if self.worker is not None:
            self.worker.fail_step_stores()

    def _transfers_failed(self, finished_req_ids: set[str]) -> "KVConnectorTransferResults":
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
        failed = self.worker.fail_async() if self.worker is not None else set()
        sent = self.worker.sending.take_all() if self.worker is not None else set()  # never held forever
        return KVConnectorTransferResults(finished_recving=set(failed), finished_sending=sent,
                                          failed_recving=set(failed) if self.hybrid else set())

    def _load_errors_failed(self) -> set[int]:
        errors = self.worker.take_load_errors(finish=False) if self.worker is not None else set()
        return set() if self.hybrid else errors

    def _worker_meta_failed(self) -> KVTierWorkerMeta | None:
        return self.worker.take_report(finish=False) if self.worker is not None else None

    def _lookup_failed(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        if self.sched is not None:
            self.sched.release(request.request_id)
        return 0, False

    def _alloc_failed(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        if self.sched is not None:
            self.sched.fail_alloc(request, block_ids_of(blocks), num_external_tokens)

    def _sources_failed(self, request: "Request", num_external_tokens: int) -> dict:
        return super().get_external_cache_hit_sources(request, num_external_tokens)

    def _meta_failed(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self.sched.fail_plan() if self.sched is not None else KVTierMetadata()

    def _finish_failed(self, request: "Request", block_ids: list[int]) -> tuple[bool, None]:
        if self.sched is not None:
            self.sched.release(request.request_id)
        return False, None
