"""kvtier's counters in vLLM's metrics pipeline: `KVTierStats` in, Prometheus series out.

How the numbers travel (vLLM 0.32/0.33):

1. Each side of the connector counts with `Counting._count(key, n)` (connector/metadata.py).
   vLLM collects them once per step with `get_kv_connector_stats()`: the workers' stats ride on
   the model runner output and are summed over workers (`KVTierStats.aggregate`); the scheduler
   adds its own; the sum goes to the API server process as a plain dict (`to_dict`).
2. There `KVTierPromMetrics.observe(data)` adds each interval to Prometheus counters,
   observes histograms and sets gauges, so `/metrics` shows the `vllm:kvtier_*` series below;
   and `KVTierStats.reduce` makes vLLM's periodic "KV Transfer metrics: ..." log line.

Key naming contract (what the scheduler / controller and the worker emit):

- `<name>` or `<name>.<tier>`: a counter increment; the part after the first dot is the
  `tier` label. Summed over steps and workers.
- `gauge_<name>[.<tier>]`: a current value (occupancy): the newest value replaces the older.
- `obs:<name>[.<tier>]`: a list of observations (latencies) for a histogram; lists concatenate.
- Keys not in the tables below are ignored by Prometheus (they still reach the log line);
  series whose keys were never emitted stay at 0.

Prometheus series (every one also has vLLM's `model_name` and `engine` labels):

=====================================================  ============================================
series                                                 key(s)
=====================================================  ============================================
counter vllm:kvtier_lookups_total                      n_lookups (scheduler asks per request/step)
counter vllm:kvtier_loads_total                        n_loads (requests that loaded from kvtier)
counter vllm:kvtier_hit_blocks_total{tier}             hit_blocks.<tier>
counter vllm:kvtier_hit_tokens_total{tier}             hit_tokens.<tier>
counter vllm:kvtier_miss_blocks_total                  miss_blocks
counter vllm:kvtier_miss_tokens_total                  miss_tokens
counter vllm:kvtier_loaded_bytes_total{tier}           bytes_loaded.<tier> (summed over TP ranks)
counter vllm:kvtier_stored_bytes_total{tier}           bytes_stored.<tier> (summed over TP ranks)
counter vllm:kvtier_loaded_blocks_total{tier}          blocks_loaded.<tier> (rank 0's count)
counter vllm:kvtier_stored_blocks_total{tier}          stored_blocks.<tier> (committed to the tier)
counter vllm:kvtier_load_failed_blocks_total{tier}     blocks_load_failed.<tier>
counter vllm:kvtier_load_failed_requests_total         load_failed_requests
counter vllm:kvtier_store_failed_blocks_total{tier}    store_failed_blocks.<tier>
counter vllm:kvtier_store_dropped_blocks_total{tier}   store_dropped_blocks.<tier> (tier full, pinned)
counter vllm:kvtier_not_admitted_blocks_total{tier}    not_admitted_blocks.<tier>
counter vllm:kvtier_evicted_blocks_total{tier}         evicted_blocks.<tier>
counter vllm:kvtier_demoted_blocks_total{tier}         demoted_blocks.<tier>
counter vllm:kvtier_promoted_blocks_total{tier}        promoted_blocks.<tier>
counter vllm:kvtier_checksum_failures_total{tier}      corrupt_blocks.<tier>
counter vllm:kvtier_io_errors_total{tier}              io_errors.<tier>
counter vllm:kvtier_gone_blocks_total{tier}            gone_blocks.<tier> (shared: found, then absent at load)
counter vllm:kvtier_missing_blocks_total{tier}         missing_blocks.<tier> (shared: a read found no value)
counter vllm:kvtier_unreachable_total{tier}            unreachable.<tier> (shared: failed / timed-out commands)
counter vllm:kvtier_lookup_timeouts_total{tier}        lookup_timeouts.<tier> (shared: lookup answered late)
counter vllm:kvtier_lookup_failures_total{tier}        lookup_failures.<tier> (shared: server unreachable)
counter vllm:kvtier_put_failed_blocks_total{tier}      put_failed_blocks.<tier> (shared: writes refused)
histogram vllm:kvtier_load_seconds{tier}               obs:seconds_loaded.<tier> (one per step and rank)
histogram vllm:kvtier_store_seconds{tier}              obs:seconds_stored.<tier> (one per step / NVMe batch)
gauge vllm:kvtier_resident_blocks{tier}                gauge_resident_blocks.<tier>
gauge vllm:kvtier_capacity_blocks{tier}                gauge_capacity_blocks.<tier>
gauge vllm:kvtier_leased_blocks                        gauge_leased_blocks (blocks pinned by leases)
counter vllm:kvtier_tenant_hit_blocks_total{tier,tenant}  tenant_hit_blocks.<tier>|<tenant>
counter vllm:kvtier_tenant_stored_blocks_total{tier,tenant}  tenant_stored_blocks.<tier>|<tenant>
counter vllm:kvtier_tenant_evicted_blocks_total{tier,tenant}  tenant_evicted_blocks.<tier>|<tenant>
gauge vllm:kvtier_tenant_bytes{tier,tenant}            gauge_tenant_bytes.<tier>|<tenant> (bytes held)
=====================================================  ============================================

The `tenant` label (YAML `tenants:`, kvtier/core/tenants.py) is a named tenant or `other`: at
most MAX_TENANT_LABELS values, any further one is counted as `other`.

vLLM's own `vllm:prompt_tokens_cached_by_source{source="host"|"disk"}` comes from
`KVTierConnector.get_external_cache_hit_sources`, not from here.
"""

from __future__ import annotations

from typing import Any

try:
    from prometheus_client import Counter, Gauge, Histogram
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
except Exception:  # pragma: no cover - vLLM absent: the table and to_series() still import
    Counter = Gauge = Histogram = None  # type: ignore[assignment,misc]

    class KVConnectorPromMetrics:  # type: ignore[no-redef]
        def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
            self._counter_cls = metric_types[Counter]
            self._gauge_cls = metric_types[Gauge]
            self._histogram_cls = metric_types[Histogram]
            self._labelnames = labelnames
            self.per_engine_labelvalues = per_engine_labelvalues

GAUGE_PREFIX = "gauge_"
OBS_PREFIX = "obs:"

# Prometheus name (without vllm:kvtier_ and _total) -> (stats key, has a tier label, help)
COUNTERS: dict[str, tuple[str, bool, str]] = {
    "lookups": ("n_lookups", False, "Lookups of request prefixes in kvtier's tiers."),
    "loads": ("n_loads", False, "Requests whose prefix kvtier loaded (in part or whole)."),
    "hit_blocks": ("hit_blocks", True, "Blocks served from a kvtier tier instead of recomputed."),
    "hit_tokens": ("hit_tokens", True, "Prompt tokens served from a kvtier tier."),
    "miss_blocks": ("miss_blocks", False, "Prompt blocks looked up in kvtier and not found."),
    "miss_tokens": ("miss_tokens", False, "Prompt tokens looked up in kvtier and not found."),
    "loaded_bytes": ("bytes_loaded", True, "Bytes copied from a tier into vLLM's KV cache (all ranks)."),
    "stored_bytes": ("bytes_stored", True, "Bytes written into a tier (all ranks)."),
    "loaded_blocks": ("blocks_loaded", True, "Blocks copied from a tier into vLLM's KV cache."),
    "stored_blocks": ("stored_blocks", True, "Blocks committed to a tier."),
    "load_failed_blocks": ("blocks_load_failed", True, "Blocks whose load failed (recomputed)."),
    "load_failed_requests": ("load_failed_requests", False, "Requests with a failed kvtier load."),
    "store_failed_blocks": ("store_failed_blocks", True, "Blocks whose store failed (not committed)."),
    "store_dropped_blocks": ("store_dropped_blocks", True, "Blocks not stored: no evictable room."),
    "not_admitted_blocks": ("not_admitted_blocks", True, "Blocks the admission policy kept out of a tier."),
    "evicted_blocks": ("evicted_blocks", True, "Blocks evicted from a tier."),
    "demoted_blocks": ("demoted_blocks", True, "Blocks written down to this tier on eviction above."),
    "promoted_blocks": ("promoted_blocks", True, "Blocks copied up into this tier on a lower-tier hit."),
    "checksum_failures": ("corrupt_blocks", True, "Blocks that failed checksum verification on read."),
    "io_errors": ("io_errors", True, "I/O errors of a tier (reads and writes)."),
    "gone_blocks": ("gone_blocks", True, "Shared tier: blocks found by lookup, absent or bad at load (recomputed)."),
    "missing_blocks": ("missing_blocks", True, "Shared tier: reads that found no value (server evicted it)."),
    "unreachable": ("unreachable", True, "Shared tier: commands that failed or timed out (server unreachable)."),
    "lookup_timeouts": ("lookup_timeouts", True, "Shared tier: lookups answered as misses after the timeout."),
    "lookup_failures": ("lookup_failures", True,
                        "Shared tier: lookups answered as misses because the server was unreachable."),
    "put_failed_blocks": ("put_failed_blocks", True, "Shared tier: block writes the server refused or lost."),
}
HISTOGRAMS: dict[str, tuple[str, str]] = {
    "load_seconds": ("seconds_loaded", "Time a worker spent loading from a tier in one step."),
    "store_seconds": ("seconds_stored", "Time a worker spent storing into a tier in one step (NVMe: per batch)."),
}
GAUGES: dict[str, tuple[str, bool, str]] = {
    "resident_blocks": ("gauge_resident_blocks", True, "Blocks resident in a tier."),
    "capacity_blocks": ("gauge_capacity_blocks", True, "Capacity of a tier in blocks."),
    "leased_blocks": ("gauge_leased_blocks", False, "Tier blocks pinned by leases of requests in flight."),
}
# per tenant (keys `<key>.<tier>|<tenant>`): Prometheus name -> (kind, stats key, help)
TENANT_SERIES: dict[str, tuple[str, str, str]] = {
    "tenant_hit_blocks": ("counter", "tenant_hit_blocks", "Blocks a tenant was served from a tier."),
    "tenant_stored_blocks": ("counter", "tenant_stored_blocks", "Blocks committed to a tier, charged to a tenant."),
    "tenant_evicted_blocks": ("counter", "tenant_evicted_blocks", "A tenant's blocks that left a tier."),
    "tenant_bytes": ("gauge", "gauge_tenant_bytes", "Bytes a tenant holds in a tier."),
}
MAX_TENANT_LABELS = 65   # named tenants (at most 64) and `other`
LATENCY_BUCKETS = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0]
PREFIX = "vllm:kvtier_"


def split_key(key: str) -> tuple[str, str | None]:
    """'hit_blocks.cpu' -> ('hit_blocks', 'cpu'); 'n_lookups' -> ('n_lookups', None)."""
    base, _, tier = key.partition(".")
    return base, (tier or None)


def to_series(data: dict[str, Any]) -> dict[tuple[str, str, str | None], Any]:
    """Map one interval's stats to {(kind, series name, tier): value}; kind is counter, histogram
    (value: list of observations) or gauge. Unknown keys are left out."""
    by_key = {v[0]: (k, v[1]) for k, v in COUNTERS.items()}
    hist_key = {v[0]: k for k, v in HISTOGRAMS.items()}
    gauge_key = {v[0]: (k, v[1]) for k, v in GAUGES.items()}
    out: dict[tuple[str, str, Any], Any] = {}
    tenant_key = {v[1]: (k, v[0]) for k, v in TENANT_SERIES.items()}
    for key, v in (data or {}).items():
        if "|" in key:
            base, _, rest = key.partition(".")
            tier, _, tenant = rest.rpartition("|")
            if base in tenant_key and tier and tenant and isinstance(v, (int, float)) and not isinstance(v, bool):
                name, kind = tenant_key[base]
                if kind == "gauge" or v > 0:
                    out[(kind, name, (tier, tenant))] = v
            continue
        if key.startswith(OBS_PREFIX):
            base, tier = split_key(key[len(OBS_PREFIX):])
            if base in hist_key and isinstance(v, (list, tuple)):
                out[("histogram", hist_key[base], tier)] = list(v)
            continue
        base, tier = split_key(key)
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            continue
        if base in gauge_key:
            name, tiered = gauge_key[base]
            if tiered == (tier is not None):
                out[("gauge", name, tier)] = v
        elif base in by_key:
            name, tiered = by_key[base]
            if tiered == (tier is not None) and v > 0:
                out[("counter", name, tier)] = v
    return out


class KVTierPromMetrics(KVConnectorPromMetrics):
    """Registers the `vllm:kvtier_*` series and records each interval's stats into them."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]], tiers: list[str] | None = None) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.tiers = list(tiers or ["cpu"])
        tl = list(labelnames) + ["tier"]
        self._metrics: dict[tuple[str, str], Any] = {}
        for name, (_, tiered, doc) in COUNTERS.items():
            self._metrics[("counter", name)] = self._counter_cls(
                name=PREFIX + name, documentation=doc, labelnames=tl if tiered else list(labelnames))
        for name, (_, doc) in HISTOGRAMS.items():
            self._metrics[("histogram", name)] = self._histogram_cls(
                name=PREFIX + name, documentation=doc, labelnames=tl, buckets=LATENCY_BUCKETS)
        for name, (_, tiered, doc) in GAUGES.items():
            self._metrics[("gauge", name)] = self._gauge_cls(
                name=PREFIX + name, documentation=doc, labelnames=tl if tiered else list(labelnames),
                multiprocess_mode="mostrecent")
        for name, (kind, _, doc) in TENANT_SERIES.items():
            cls = self._counter_cls if kind == "counter" else self._gauge_cls
            kw = {} if kind == "counter" else {"multiprocess_mode": "mostrecent"}
            self._metrics[(kind, name)] = cls(name=PREFIX + name, documentation=doc, labelnames=tl + ["tenant"], **kw)
        self._tenants: set[str] = set()
        # the children of every known tier exist from the start: a series never emitted reads 0
        self._children: dict[tuple, Any] = {}
        for idx in per_engine_labelvalues:
            for (kind, name), m in self._metrics.items():
                if name in TENANT_SERIES:   # created when a tenant is first counted
                    continue
                tiered = kind == "histogram" or (COUNTERS.get(name) or GAUGES.get(name) or (0, True))[1]
                for tier in (self.tiers if tiered else [None]):
                    self._child(kind, name, tier, idx)

    def _child(self, kind: str, name: str, tier: str | None, engine_idx: int):
        k = (kind, name, tier, engine_idx)
        c = self._children.get(k)
        if c is None:
            values = list(self.per_engine_labelvalues.get(engine_idx, [None, str(engine_idx)]))
            if isinstance(tier, tuple):
                values.extend(tier)
            elif tier is not None:
                values.append(tier)
            c = self._children[k] = self._metrics[(kind, name)].labels(*values)
        return c

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for (kind, name, tier), v in to_series(transfer_stats_data).items():
            if isinstance(tier, tuple) and tier[1] not in self._tenants:
                if len(self._tenants) < MAX_TENANT_LABELS - 1 or tier[1] == "other":
                    self._tenants.add(tier[1])
                else:
                    tier = (tier[0], "other")
            c = self._child(kind, name, tier, engine_idx)
            if kind == "counter":
                c.inc(v)
            elif kind == "gauge":
                c.set(v)
            else:
                for x in v:
                    c.observe(x)
