"""kvtier's counters in vLLM's metrics pipeline: `KVTierStats` in, Prometheus series out.

How the numbers travel (vLLM 0.32/0.33):

1. Each side of the connector counts into its `Counters` (`count(key, n)`, kvtier/core/plan.py).
   vLLM collects them once per step with `get_kv_connector_stats()`: the workers' stats ride on
   the model runner output and are summed over workers (`KVTierStats.aggregate`); the scheduler
   adds its own; the sum goes to the API server process as a plain dict (`to_dict`).
2. There `KVTierPromMetrics.observe(data)` adds each interval to Prometheus counters,
   observes histograms and sets gauges, so `/metrics` shows the `vllm:kvtier_*` series below;
   and `KVTierStats.reduce` makes vLLM's periodic "KV Transfer metrics: ..." log line.

Keys, series and help text are declared once, in `Metric` (kvtier/common/counters.py): a member with an
`export` is one `vllm:kvtier_<prom>` series (a counter's name ends in `_total`), its `help` the
series' documentation. Key forms:

- `<key>` or `<key>.<tier>`: a counter increment; the part after the first dot is the `tier`
  label. Summed over steps and workers.
- `gauge_<name>[.<tier>]`: a current value (occupancy): the newest value replaces the older.
- `obs:<key>.<tier>`: a list of observations (latencies) for a histogram; lists concatenate.
- `<key>.<tier>|<tenant>`: per tenant, with a `tenant` label.
- Keys of members without an export are left out of Prometheus (they still reach the log line);
  series whose keys were never emitted stay at 0. Every series also has vLLM's `model_name` and
  `engine` labels.

The `tenant` label (YAML `tenants:`, kvtier/core/tenants.py) is a named tenant or `other`: at
most MAX_TENANT_LABELS values, any further one is counted as `other`.

vLLM's own `vllm:prompt_tokens_cached_by_source{source="host"|"disk"}` comes from
`KVTierConnector.get_external_cache_hit_sources`, not from here.
"""

from __future__ import annotations

from typing import Any

from kvtier.common.counters import BY_KEY, COUNTER, GAUGE, HISTOGRAM, OBS_PREFIX, TENANT, TIER, Metric

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

# the series of each kind: Prometheus name -> member
COUNTERS = {m.prom: m for m in Metric.exported() if m.export == COUNTER and m.per != TENANT}
HISTOGRAMS = {m.prom: m for m in Metric.exported() if m.export == HISTOGRAM}
GAUGES = {m.prom: m for m in Metric.exported() if m.export == GAUGE and m.per != TENANT}
TENANT_SERIES = {m.prom: m for m in Metric.exported() if m.per == TENANT}
MAX_TENANT_LABELS = 65   # named tenants (at most 64) and `other`
LATENCY_BUCKETS = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0]
PREFIX = "vllm:kvtier_"


def split_key(key: str) -> tuple[str, str | None]:
    """'hit_blocks.cpu' -> ('hit_blocks', 'cpu'); 'n_lookups' -> ('n_lookups', None)."""
    base, _, tier = key.partition(".")
    return base, (tier or None)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def to_series(data: dict[str, Any]) -> dict[tuple[str, str, str | None], Any]:
    """Map one interval's stats to {(kind, series name, tier): value}; kind is counter, histogram
    (value: list of observations) or gauge. Keys of no exported member are left out."""
    out: dict[tuple[str, str, Any], Any] = {}
    for key, v in (data or {}).items():
        if "|" in key:
            base, _, rest = key.partition(".")
            tier, _, tenant = rest.rpartition("|")
            m = BY_KEY.get(base)
            if m is not None and m.per == TENANT and tier and tenant and _number(v):
                if m.export == GAUGE or v > 0:
                    out[(m.export, m.prom, (tier, tenant))] = v
            continue
        if key.startswith(OBS_PREFIX):
            base, tier = split_key(key[len(OBS_PREFIX):])
            m = BY_KEY.get(base)
            if m is not None and m.export == HISTOGRAM and isinstance(v, (list, tuple)):
                out[(HISTOGRAM, m.prom, tier)] = list(v)
            continue
        base, tier = split_key(key)
        m = BY_KEY.get(base)
        if m is None or not _number(v) or m.per == TENANT or (m.per == TIER) != (tier is not None):
            continue
        if m.export == GAUGE:
            out[(GAUGE, m.prom, tier)] = v
        elif m.export == COUNTER and v > 0:
            out[(COUNTER, m.prom, tier)] = v
    return out


class KVTierPromMetrics(KVConnectorPromMetrics):
    """Registers the `vllm:kvtier_*` series and records each interval's stats into them."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]], tiers: list[str] | None = None) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.tiers = list(tiers or ["cpu"])
        tl = list(labelnames) + ["tier"]
        self._metrics: dict[tuple[str, str], Any] = {}
        for m in Metric.exported():
            labels = tl + ["tenant"] if m.per == TENANT else tl if m.per == TIER else list(labelnames)
            if m.export == COUNTER:
                metric = self._counter_cls(name=PREFIX + m.prom, documentation=m.help, labelnames=labels)
            elif m.export == HISTOGRAM:
                metric = self._histogram_cls(name=PREFIX + m.prom, documentation=m.help, labelnames=labels,
                                             buckets=LATENCY_BUCKETS)
            else:
                metric = self._gauge_cls(name=PREFIX + m.prom, documentation=m.help, labelnames=labels,
                                         multiprocess_mode="mostrecent")
            self._metrics[(m.export, m.prom)] = metric
        self._tenants: set[str] = set()
        # the children of every known tier exist from the start: a series never emitted reads 0
        self._children: dict[tuple, Any] = {}
        for idx in per_engine_labelvalues:
            for (kind, name), m in self._metrics.items():
                if name in TENANT_SERIES:   # created when a tenant is first counted
                    continue
                tiered = (COUNTERS.get(name) or GAUGES.get(name) or HISTOGRAMS[name]).per == TIER
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
