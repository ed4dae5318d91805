"""The connector's counters into vLLM's stats hooks (the series: connector/metrics.py).

vLLM calls `get_kv_connector_stats` once per step on each side: `worker_stats` on a worker,
`SchedulerStats.interval` on the scheduler side, which also writes its totals into each NVMe
directory (`kvtier inspect --watch`) and its state into the run directory (`--server`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from kvtier.common.once import Once, cause
from kvtier.core.serving_stats import HEARTBEAT_S, write_server_state, write_stats
from kvtier.tiers.contract import Medium
from kvtier.common.counters import HISTOGRAM, OBS_PREFIX, Metric, declared

from .config import load_settings
from .metadata import KVTierStats
from .metrics import KVTierPromMetrics

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger("kvtier.connector")


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
            self._heartbeat = threading.Thread(target=self._beat, name="kvtier-state", daemon=True)
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

    def _beat(self) -> None:
        while not self.closed:
            time.sleep(HEARTBEAT_S)
            if not self.closed and time.monotonic() - self._stats_at >= HEARTBEAT_S:
                try:
                    self.publish(force=True)
                except Exception as e:  # never out of a daemon thread; the next beat tries again
                    log.debug("kvtier: state heartbeat: %s", e)

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
