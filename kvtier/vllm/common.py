"""What kvtier's two secondary tiers share: building the kvtier tier from the tier's dict, the
primary tier's chunks as tensors, finished-job bookkeeping and the counters vLLM exports.

Every hook catches what the tier raises: a failure is a miss or a failed job, logged once and
counted (``vllm:kv_offload_kvtier_events{tier, event}``), never an exception into vLLM.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any, ClassVar

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (Locality, OffloadingCounterMetadata, OffloadingMetricMetadata, OffloadKey,
                                     ReqContext, RequestOffloadingContext)
from vllm.v1.kv_offload.tiering.base import JobId, JobResult, SecondaryTierManager

from kvtier.core.builder import build_tier
from kvtier.common.once import Once
from kvtier.common.counters import EVENTS_METRIC, Metric

from .options import chunk_fingerprint, tier_stack

log = logging.getLogger("kvtier.vllm")


class KvtierSecondaryTier(SecondaryTierManager):
    """Base of `KvtierNvmeTier` and `KvtierSharedTier`: one kvtier tier (`self.tier`, built by
    kvtier's builder from the validated dict) below vLLM's CPU primary tier."""

    kind: ClassVar[str] = ""

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: Any = None, locality: str | None = None, **options: Any) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality(locality) if locality is not None else None
        bb = self.block_size_bytes
        self.fingerprint = chunk_fingerprint(offloading_spec, bb, options.pop("namespace", None),
                                             options.pop("model_identity", None))
        cfg = tier_stack(self.kind, tier_type, options, bb, self.fingerprint["block_tokens"], self.fingerprint)
        self.tier = build_tier(cfg, 1, "full", self.fingerprint)
        arr = np.asarray(primary_kv_view)
        self._rows = torch.from_numpy(arr.reshape(arr.shape[0], -1)).view(torch.uint8)
        self._done: list[JobResult] = []
        self.counters: dict[str, int] = {}
        self._reported: dict[str, int] = {}
        self._once = Once(log)
        log.info("kvtier: vLLM secondary tier %s: %s", tier_type, self.tier.summary())

    # ---- helpers ------------------------------------------------------------------------
    def rows(self, chunk_ids: Iterable[int]) -> list[torch.Tensor]:
        """The primary tier's chunks `chunk_ids`, as uint8 tensors over its memory (no copy)."""
        r = self._rows
        return [r[int(c)] for c in chunk_ids]

    def release_primary(self) -> None:
        """Drop the views of the primary tier's memory (vLLM unmaps it after shutdown)."""
        self._rows = None
        self._primary_kv_view = None

    def count(self, event: Metric, n: int = 1) -> None:
        if n:
            self.counters[event.key] = self.counters.get(event.key, 0) + n

    def failed(self, what: str, e: BaseException) -> None:
        """A hook that failed: logged once per cause, counted."""
        self.count(Metric.errors_of(what))
        self._once((what, type(e).__name__), logging.ERROR, "kvtier: secondary tier %s: %s failed: %s",
                   self.tier_type, what, e)

    def finish(self, job_id: JobId, ok: bool, keys: list[OffloadKey] | None = None, t0: float | None = None,
               nbytes: int = 0) -> None:
        """Report a job done; `keys`: the ones that succeeded when not all did (loads)."""
        self._done.append(JobResult(job_id=job_id, success=ok, successful_keys=tuple(keys) if keys else None,
                                    transfer_time=time.monotonic() - t0 if t0 is not None else None,
                                    transfer_bytes=nbytes or None))

    def take_done(self) -> list[JobResult]:
        out, self._done = self._done, []
        return out

    # ---- SecondaryTierManager -----------------------------------------------------------
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return {EVENTS_METRIC: OffloadingCounterMetadata(
            documentation="kvtier secondary tier events (corrupt chunks, misses at load, I/O and server errors), "
                          "labeled by tier and event.", labelnames=("tier", "event"))}

    def get_stats(self) -> OffloadingConnectorStats | None:
        stats = None
        for k, v in self.all_counters().items():
            d = v - self._reported.get(k, 0)
            if d > 0:
                stats = stats or OffloadingConnectorStats()
                stats.increase_counter(EVENTS_METRIC, d, (self.tier_type, k))
                self._reported[k] = v
        return stats

    def all_counters(self) -> dict[str, int]:
        """This adapter's counters and the tier's own (corrupt blocks, I/O and server errors)."""
        return dict(self.counters)
