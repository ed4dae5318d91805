"""What the scheduler side tells the workers each step, what the workers tell back, and stats.

Everything here is plain data (picklable / msgspec-friendly): it crosses process boundaries
when vLLM runs the scheduler and the workers in different processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

try:  # vLLM is optional for the pure-Python parts (unit tests, offline use)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorMetadata,
                                                                     KVConnectorWorkerMetadata)
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


@dataclass
class LoadOp:
    """Copy tier slots into GPU blocks (before the forward that reads them)."""

    req_id: str
    tier: int
    slots: list[int]
    block_ids: list[int]
    checksums: list[int | tuple[int, ...]] | None = None  # NVMe: expected xxh3_64 per slot (per rank: a tuple)
    via: list[int] | None = None         # NVMe: CPU slots to read through (promotion), reported as op_id
    op_id: int = 0


@dataclass
class StoreOp:
    """Copy GPU blocks into tier slots the scheduler reserved (after the forward that wrote them)."""

    op_id: int
    tier: int
    slots: list[int]
    block_ids: list[int]


@dataclass
class NvmeWriteOp:
    """Write-through: copy CPU slots (written by this step's stores or earlier) to NVMe slots."""

    op_id: int
    src_slots: list[int]
    slots: list[int]


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    loads: list[LoadOp] = field(default_factory=list)
    stores: list[StoreOp] = field(default_factory=list)
    nvme_writes: list[NvmeWriteOp] = field(default_factory=list)
    nvme_dir: str | None = None          # where the worker opens the NVMe data file
    nvme_capacity: int = 0

    def is_empty(self) -> bool:
        return not self.loads and not self.stores and not self.nvme_writes


@dataclass
class KVTierWorkerMeta(KVConnectorWorkerMetadata):
    """Per-step results from the workers: store op -> per-block ok, request -> load ok.

    Aggregating over workers (tensor parallel ranks) ANDs the flags: a block is committed
    only when every rank wrote its shard.
    """

    stored: dict[int, list[bool]] = field(default_factory=dict)
    loaded: dict[str, bool] = field(default_factory=dict)
    # NVMe write op -> per-slot xxh3_64 of the bytes this rank wrote and fdatasync'd (-1: failed)
    nvme_written: dict[int, list[int]] = field(default_factory=dict)
    # tier index -> slots whose bytes failed verification on read
    corrupt: dict[int, list[int]] = field(default_factory=dict)
    rank: int = 0   # the worker's rank: its shard of each block, in its own NVMe data file
    # aggregated over ranks: NVMe write op -> rank -> per-slot checksums
    nvme_written_ranks: dict[int, dict[int, list[int]]] = field(default_factory=dict)

    def written_by_rank(self) -> dict[int, dict[int, list[int]]]:
        """NVMe write op -> rank -> per-slot checksums (-1: failed), over every rank reported."""
        out = {op: dict(r) for op, r in self.nvme_written_ranks.items()}
        for op, sums in self.nvme_written.items():
            out.setdefault(op, {})[self.rank] = list(sums)
        return out

    def aggregate(self, other: "KVTierWorkerMeta") -> "KVTierWorkerMeta":
        stored = dict(self.stored)
        for op, oks in other.stored.items():
            mine = stored.get(op)
            stored[op] = list(oks) if mine is None else [a and b for a, b in zip(mine, oks)]
        loaded = dict(self.loaded)
        for r, ok in other.loaded.items():
            loaded[r] = loaded.get(r, True) and ok
        # ranks hold different shards in different files: their checksums are kept per rank
        written = self.written_by_rank()
        for op, by_rank in other.written_by_rank().items():
            written.setdefault(op, {}).update(by_rank)
        corrupt = {t: list(v) for t, v in self.corrupt.items()}
        for t, v in other.corrupt.items():
            corrupt.setdefault(t, []).extend(s for s in v if s not in corrupt[t])
        return KVTierWorkerMeta(stored=stored, loaded=loaded, corrupt=corrupt, rank=self.rank,
                                nvme_written_ranks=written)


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
            if k.startswith("gauge_"):
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
                    out[f"{k[len('obs:'):] if k.startswith('obs:') else k}_ms_mean"] = round(
                        1e3 * sum(v) / len(v), 3)
                continue
            out[k] = round(v, 6) if isinstance(v, float) else v
        for d in ("loaded", "stored"):
            for k in list(self.data):
                if k.startswith(f"bytes_{d}."):
                    tier = k.split(".", 1)[1]
                    secs = self.data.get(f"seconds_{d}.{tier}", 0.0)
                    if secs > 0:
                        out[f"gbps_{d}.{tier}"] = round(self.data[k] / secs / 1e9, 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class Counting:
    """Counters kept on each side: cumulative `totals`, and the interval vLLM collects."""

    def _init_counters(self) -> None:
        self.totals: dict[str, float] = {}
        self._interval = KVTierStats()

    def _count(self, key: str, v: float = 1) -> None:
        self._interval.add(key, v)
        self.totals[key] = self.totals.get(key, 0) + v

    def take_interval_stats(self) -> KVTierStats | None:
        if self._interval.is_empty():
            return None
        s, self._interval = self._interval, KVTierStats()
        return s
