"""No exception leaves a vLLM hook.

vLLM runs the connector's hooks inside its engine loop: an exception there kills the engine
(EngineDeadError, every request fails, the server exits). kvtier is a cache, so every failure
has a safe answer: a lookup finds nothing, a load that cannot run is reported as a load error
(vLLM recomputes those blocks), a store that cannot run is dropped (a future miss).

`hook` wraps each of the connector's hooks; what it does on a failure is the side's: the
scheduler and each worker own a guard (`SchedulerGuard`, `WorkerGuard`) that counts the failure,
logs it once per hook and cause (`kvtier.common.once.Once`: a full disk fails every step) and
gives the safe answer, from that side's own state.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any, Callable

from kvtier.common.once import Once, cause
from kvtier.tiers.redact import redact
from kvtier.common.counters import Metric

from .metadata import KVTierWorkerMeta, block_ids_of

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorTransferResults
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

log = logging.getLogger("kvtier.connector")


def hook(recover: str | None = None, default: Any = None, refuse: tuple = (), name: str | None = None) -> Callable:
    """Decorate a connector hook: on an exception, `self.guard.failed(name, e)` logs it (once per
    hook and cause) and counts it, then the hook answers `self.guard.<recover>(*args)` or
    `default`. Exceptions of the `refuse` types pass through (a start-up that must not go on)."""
    def deco(fn: Callable) -> Callable:
        called = name or fn.__name__

        @functools.wraps(fn)
        def wrapper(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(self, *args, **kwargs)
            except refuse:
                raise
            except Exception as e:  # noqa: BLE001 - the engine must survive any failure of ours
                guard = self.guard
                guard.failed(called, e)
                if recover is None:
                    return default() if callable(default) else default
                try:
                    return getattr(guard, recover)(*args, **kwargs)
                except Exception as e2:  # noqa: BLE001
                    guard.failed(called + ".recover", e2)
                    return default() if callable(default) else default
        return wrapper
    return deco


class Guard:
    """A side's failures: each counted (`hook_errors.<hook>`), logged once per hook and cause."""

    def __init__(self, count: Callable[..., None]) -> None:
        self.count = count
        self._once = Once(log)

    def failed(self, name: str, e: BaseException) -> None:
        self.count(Metric.HOOK_ERRORS.at(name))
        self._once(("hook", name) + cause(e), logging.ERROR,
                   "kvtier: %s failed (%s: %s); answered as a miss / recompute, vLLM keeps serving "
                   "(counted in hook_errors; later failures of this kind are logged at DEBUG)",
                   name, type(e).__name__, redact(str(e)), exc_info=e)


class SchedulerGuard(Guard):
    """The scheduler side's safe answers (`KVTierScheduler.guard`): no lease or pending slot is
    left behind, loads vLLM accepted become load errors (recomputed)."""

    def __init__(self, sched: Any) -> None:
        super().__init__(sched.count)
        self.sched = sched

    def lookup_failed(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        self.sched.release(request.request_id)
        return 0, False

    def alloc_failed(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        self.sched.fail_alloc(request, block_ids_of(blocks), num_external_tokens)

    def meta_failed(self, scheduler_output: Any) -> "KVConnectorMetadata":
        return self.sched.fail_plan()

    def finish_failed(self, request: "Request", block_ids: Any) -> tuple[bool, None]:
        self.sched.release(request.request_id)
        return False, None


class WorkerGuard(Guard):
    """A worker's safe answers (`KVTierWorker.guard`): the step's loads fail as load errors, its
    stores are dropped, a request waiting for its load or held for its stores is never kept."""

    def __init__(self, worker: Any) -> None:
        super().__init__(worker.count)
        self.worker = worker

    def register_failed(self, kv_caches: dict) -> None:
        log.error("kvtier: worker rank %s runs without kvtier: every planned load is recomputed, "
                  "nothing is stored", self.worker.rank)
        self.worker.disable()

    def load_failed(self, *args: Any, **kwargs: Any) -> None:
        self.worker.fail_step_loads()

    def layer_wait_failed(self, layer_name: str) -> None:
        self.worker.settle_loads()   # never an early return: the host waits, or the loads fail

    def save_failed(self) -> None:
        self.worker.fail_step_stores()

    def transfers_failed(self, finished_req_ids: set[str]) -> "KVConnectorTransferResults":
        """Every waiting load failed (the connector keeps `failed_recving` for a hybrid model only)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
        failed = self.worker.fail_async()
        sent = self.worker.sending.take_all()   # never held forever
        return KVConnectorTransferResults(finished_recving=set(failed), finished_sending=sent,
                                          failed_recving=set(failed))

    def load_errors_failed(self) -> set[int]:
        return self.worker.take_load_errors(finish=False)

    def worker_meta_failed(self) -> KVTierWorkerMeta | None:
        return self.worker.take_report(finish=False)

