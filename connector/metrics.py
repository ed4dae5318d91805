"""kvtier's counters in vLLM's metrics pipeline: the stats hooks in, Prometheus series out.

vLLM calls `get_kv_connector_stats` once per step on each side: `worker_stats` on a worker,
`SchedulerStats.interval` on the scheduler side, which also writes its totals into each NVMe
directory (`kvtier inspect --watch`) and its state into the run directory (`--server`).

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

import logging
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from kvtier.common.counters import BY_KEY, COUNTER, GAUGE, HISTOGRAM, OBS_PREFIX, TENANT, TIER, Metric, declared
from kvtier.common.once import Once, cause
from kvtier.core.serving_stats import HEARTBEAT_S, write_server_state, write_stats
from kvtier.tiers.contract import Medium

from .config import load_settings
from .metadata import KVTierStats

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

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger("kvtier.connector")

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


# ---- the connector's counters into vLLM's stats hooks ------------------------------------------------


def worker_stats(worker: Any) -> KVTierStats | None:
    """A worker's counters of this step: each per-step time becomes one histogram observation
    (`obs:seconds_*`), and ranks other than 0 leave out their block counts (a block is one block,
    whatever the ranks; bytes add up over ranks)."""
    s = worker.take_interval_stats()
    if s is None:
        return None
    for k, v in list(s.data.items()):
        m = declared(k)
        if m is not None and m.export == HISTOGRAM and "." in k and v > 0:
            s.data[OBS_PREFIX + k] = [float(v)]
        if worker.rank != 0 and m in (Metric.BLOCKS_LOADED, Metric.BLOCKS_STORED) and "." in k:
            del s.data[k]
    return s


def connector_stats(data: dict[str, Any] | None = None) -> KVTierStats:
    """`build_kv_connector_stats`: the counters vLLM carries from the engine to its logger."""
    return KVTierStats(data=dict(data or {}))


def prom_metrics(vllm_config: "VllmConfig", metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> KVTierPromMetrics:
    """The `vllm:kvtier_*` series on the API server's /metrics (connector/metrics.py)."""
    tiers = ["cpu"]
    try:
        kvt = vllm_config.kv_transfer_config
        cfg = load_settings(dict(kvt.kv_connector_extra_config or {}))
        tiers = [t.name for t in cfg.storage_tiers()]
    except Exception as e:  # the series still exist; other tiers appear when first counted
        log.warning("kvtier: metrics: could not read the tier config (%s); assuming a cpu tier", e)
    return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues, tiers=tiers)


class SchedulerStats:
    """The scheduler side's counters: each step's for vLLM, with the tiers' gauges when they
    changed; its totals and state for `kvtier inspect`, written from the steps, a heartbeat
    thread while idle, and the shutdown."""

    def __init__(self, sched: Any, recorder: Any, config: Any, block_tokens: int, fingerprint: dict) -> None:
        self.sched, self.recorder, self.config = sched, recorder, config
        self.block_tokens, self.fingerprint = block_tokens, fingerprint or {}
        self.closed = False
        self._last_gauges: dict[str, float] = {}
        self._stats_at = float("-inf")
        self._once = Once(log)
        self._heartbeat: threading.Thread | None = None
        self._state_lock = threading.Lock()
        self._stopped = False

    def interval(self) -> KVTierStats | None:
        """This step's counters (see connector/metrics.py): tier occupancy and leases as gauges,
        when they changed."""
        s = self.sched.take_interval_stats()
        self.publish()
        gauges = {k: v for k, v in self.gauges().items() if self._last_gauges.get(k) != v}
        if gauges:
            self._last_gauges.update(gauges)
            s = s if s is not None else KVTierStats()
            for k, v in gauges.items():
                s.data.setdefault(k, v)  # a controller that reports its own gauges wins
        return s

    def close(self) -> None:
        """The connector shuts down: no heartbeat from now on (the shutdown writes the last state)."""
        self.closed = True

    def publish(self, force: bool = False, final: bool = False) -> None:
        """The scheduler's totals into each NVMe directory and its state (directories, geometry,
        counters) into the run directory (`kvtier inspect --server`): at most once a second from
        the steps, every HEARTBEAT_S from a thread while idle, and at shutdown (`final`)."""
        now = time.monotonic()
        if not force and now - self._stats_at < 1.0:
            return
        self._stats_at = now
        if self._heartbeat is None and not final and not self.closed:   # first called at start, one thread
            self._heartbeat = threading.Thread(target=_beat, args=(weakref.ref(self),), name="kvtier-state",
                                               daemon=True)
            self._heartbeat.start()
        with self._state_lock:
            if self._stopped:   # the final state stays the last written
                return
            self._stopped = final
            try:
                totals = dict(self.sched.totals)
            except RuntimeError:   # changed size while copied (the scheduler thread): the next beat
                return
            try:
                for t in self.sched.nvme_tiers():
                    write_stats(t.dir, totals)
                write_server_state(self._server_state(totals, final))
            except Exception as e:  # noqa: BLE001 - what inspect reads never fails a start, a step or a stop
                self.sched.count(Metric.STATE_WRITE_ERRORS.key)
                self._once(("server_state",) + cause(e), logging.WARNING,
                           "kvtier: the server's state for kvtier inspect not written: %s", e)

    def beat(self) -> bool:
        """One heartbeat: the state rewritten when no step wrote it for HEARTBEAT_S; False once closed."""
        if self.closed:
            return False
        if time.monotonic() - self._stats_at >= HEARTBEAT_S:
            try:
                self.publish(force=True)
            except Exception as e:  # never out of a daemon thread; the next beat tries again
                log.debug("kvtier: state heartbeat: %s", e)
        return True

    def _server_state(self, totals: dict, final: bool) -> dict:
        cfg, fp, rec = self.config, self.fingerprint, self.recorder
        kinds = {t.name: t.kind for t in cfg.storage_tiers()}
        return {"stopped": time.time() if final else None, "config": cfg.source,
                "geometry": {"block_tokens": self.block_tokens, "block_bytes": cfg.block_bytes,
                             "model": fp.get("model"), "dtype": fp.get("dtype"),
                             "kv_dtype": fp.get("dtype") if fp.get("kv_cache_dtype") in (None, "auto")
                             else fp.get("kv_cache_dtype"),
                             "layout": fp.get("layout")},
                "tiers": [{"name": t.name, "kind": kinds.get(t.name, str(t.medium)),
                           "dir": getattr(t, "dir", None) if t.medium is Medium.FILE else None,
                           "capacity_blocks": int(t.capacity_blocks or 0), "resident_blocks": int(t.num_used or 0)}
                          for t in self.sched.tiers],
                "record_trace": rec.path if rec is not None and rec.active else None, "totals": totals,
                **({"tenants": self.sched.ctrl.tenants.stats(totals)} if self.sched.ctrl.tenants is not None else {})}

    def gauges(self) -> dict[str, float]:
        """Occupancy of each local tier and blocks held by leases (the shared tier's server keeps
        its own)."""
        out: dict[str, float] = {}
        for t in self.sched.tiers:
            if not t.shared:
                out[Metric.RESIDENT_BLOCKS.at(t.name)] = int(t.num_used)
                out[Metric.CAPACITY_BLOCKS.at(t.name)] = int(t.capacity_blocks)
        out[Metric.LEASED_BLOCKS.key] = self.sched.leased_blocks()
        out.update(self.sched.tenant_gauges())   # bytes each tenant holds per tier (kvtier.core.tenants)
        return out


def _beat(ref: "weakref.ref[SchedulerStats]") -> None:
    """The state heartbeat's thread: it holds its stats object weakly, so a connector dropped without
    a shutdown (a test, an engine torn down) stops beating instead of writing a stale state."""
    while True:
        time.sleep(HEARTBEAT_S)
        stats = ref()
        if stats is None or not stats.beat():
            return
        del stats
