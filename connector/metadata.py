"""What the scheduler side tells the workers each step, what the workers tell back, and stats.

Everything here is plain data (picklable / msgspec-friendly): it crosses process boundaries
when vLLM runs the scheduler and the workers in different processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvtier.common.counters import GAUGE_PREFIX, OBS_PREFIX, Metric
from kvtier.core.plan import CopyOp, Counters, LoadOp, Report, StoreOp  # noqa: F401  (the ops the workers run)

try:  # vLLM is optional for the pure-Python parts (unit tests, offline use)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata
except Exception:  # pragma: no cover - vLLM absent
    class KVConnectorMetadata:  # type: ignore[no-redef]
        pass

    class KVConnectorWorkerMetadata:  # type: ignore[no-redef]
        def aggregate(self, other):
            raise NotImplementedError

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
except Exception:  # pragma: no cover
    @dataclass
    class KVConnectorStats:  # type: ignore[no-redef]
        data: dict[str, Any] = field(default_factory=dict)


HOLD_LIMIT_S = 60.0   # the longest a worker holds a finished request for its stores (`sending`)


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    """The controller's plan for this step, as vLLM hands it to the workers."""

    loads: list[LoadOp] = field(default_factory=list)
    stores: list[StoreOp] = field(default_factory=list)
    copies: list[CopyOp] = field(default_factory=list)
    nvme_tier: int | None = None         # index of the NVMe tier, whose data file the worker opens ...
    nvme_dir: str | None = None          # ... there
    nvme_capacity: int = 0
    shared_tier: int | None = None       # index of the shared tier (its ops name blocks by key)
    async_loads: list[str] = field(default_factory=list)  # requests vLLM loads asynchronously
    idle: bool = False                   # nothing scheduled but asynchronous loads: the worker may wait
    tier_names: list[str] | None = None
    model_identity: str | None = None    # the model's identity once known (the worker opens the shared tier)
    failed_loads: dict[str, list[int]] = field(default_factory=dict)  # accepted, not planned: load errors
    sending: dict[str, list[int]] = field(default_factory=dict)  # finished, held for these stores (vLLM's delay-free protocol)
    settle: list[int] = field(default_factory=list)  # GPU blocks vLLM may rewrite from this step on (`handle_preemptions`)

    def is_empty(self) -> bool:
        return not self.loads and not self.stores and not self.copies and not self.failed_loads


@dataclass
class KVTierWorkerMeta(Report, KVConnectorWorkerMetadata):
    """A worker's report for one step (see `kvtier.core.plan.Report`); vLLM aggregates it over ranks."""


@dataclass
class KVTierStats(KVConnectorStats):
    """kvtier's counters since the last collection, as vLLM carries them from workers to metrics.

    Keys (see connector/metrics.py for the Prometheus mapping): `<counter>` or `<counter>.<tier>`
    add up over steps and workers; `gauge_<name>[.<tier>]` replace (newest wins);
    `obs:<name>[.<tier>]` are lists of observations that concatenate.
    """

    def reset(self) -> None:
        self.data = {}

    def add(self, key: str, value: float) -> None:
        self.data[key] = self.data.get(key, 0) + value

    def aggregate(self, other: "KVConnectorStats") -> "KVTierStats":
        for k, v in (other.data or {}).items():
            if k.startswith(GAUGE_PREFIX):
                self.data[k] = v
            elif isinstance(v, (list, tuple)):
                self.data[k] = list(self.data.get(k, [])) + list(v)
            elif isinstance(v, (int, float)):
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        """One interval's summary for vLLM's "KV Transfer metrics" log line: counters, gauges,
        per-tier GB/s, and per-step latency means of the observation lists (ms)."""
        out: dict[str, int | float] = {}
        for k, v in sorted(self.data.items()):
            if isinstance(v, (list, tuple)):
                if v:
                    out[f"{k.removeprefix(OBS_PREFIX)}_ms_mean"] = round(
                        1e3 * sum(v) / len(v), 3)
                continue
            out[k] = round(v, 6) if isinstance(v, float) else v
        for d, nbytes, took in (("loaded", Metric.BYTES_LOADED, Metric.SECONDS_LOADED),
                                ("stored", Metric.BYTES_STORED, Metric.SECONDS_STORED)):
            for k in list(self.data):
                if k.startswith(nbytes.at("")):
                    tier = k.split(".", 1)[1]
                    secs = self.data.get(took.at(tier), 0.0)
                    if secs > 0:
                        out[f"gbps_{d}.{tier}"] = round(self.data[k] / secs / 1e9, 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


def interval_stats(counters: Counters) -> KVTierStats | None:
    """The interval vLLM collects from a side's counters (None when nothing was counted)."""
    d = counters.take_interval()
    return KVTierStats(data=d) if d else None


def block_ids_of(blocks: Any) -> Any:
    """vLLM's KVCacheBlocks as block ids per group; None when empty."""
    try:
        return blocks.get_block_ids()
    except Exception:  # empty KVCacheBlocks
        return None


def group0_ids(ids: Any) -> list[int] | None:
    """The first KV-cache group's block ids, or None."""
    if not ids:
        return None
    return list(ids[0])
