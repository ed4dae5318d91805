"""kvtier's stats in vLLM's metrics pipeline, without a server: the aggregation rules, the
key -> series map, and the Prometheus series KVTierPromMetrics registers and fills."""

from __future__ import annotations

import pytest

prometheus_client = pytest.importorskip("prometheus_client")
pytest.importorskip("vllm")

from kvtier.connector.metadata import KVTierStats  # noqa: E402
from kvtier.connector.metrics import KVTierPromMetrics, to_series  # noqa: E402


def test_stats_aggregate_sum_replace_concat():
    a = KVTierStats(data={"hit_blocks.cpu": 2, "gauge_resident_blocks.cpu": 5, "obs:seconds_loaded.cpu": [0.1]})
    b = KVTierStats(data={"hit_blocks.cpu": 3, "gauge_resident_blocks.cpu": 7, "obs:seconds_loaded.cpu": [0.3],
                          "n_lookups": 1})
    a.aggregate(b)
    assert a.data == {"hit_blocks.cpu": 5, "gauge_resident_blocks.cpu": 7, "obs:seconds_loaded.cpu": [0.1, 0.3],
                      "n_lookups": 1}
    r = a.reduce()
    assert r["hit_blocks.cpu"] == 5 and r["seconds_loaded.cpu_ms_mean"] == pytest.approx(200.0)
    assert KVTierStats().is_empty() and not a.is_empty()


def test_to_series_maps_known_keys_only():
    s = to_series({"hit_blocks.cpu": 4, "n_lookups": 2, "bytes_loaded.nvme": 10, "corrupt_blocks.nvme": 1,
                   "gauge_leased_blocks": 3, "obs:seconds_stored.nvme": [0.5], "whatever.cpu": 9,
                   "hit_blocks": 7, "n_lookups.cpu": 1, "evicted_blocks.cpu": 0})
    assert s == {("counter", "hit_blocks", "cpu"): 4, ("counter", "lookups", None): 2,
                 ("counter", "loaded_bytes", "nvme"): 10, ("counter", "checksum_failures", "nvme"): 1,
                 ("gauge", "leased_blocks", None): 3, ("histogram", "store_seconds", "nvme"): [0.5]}


def test_to_series_shared_tier_failures():
    """Every failure the shared tier counts is a series: a lookup while the server is down (the
    breaker open: no command sent, so no `unreachable`) is only a lookup failure."""
    keys = ["gone_blocks", "missing_blocks", "unreachable", "lookup_timeouts", "lookup_failures",
            "put_failed_blocks"]
    s = to_series({f"{k}.shared": 1 for k in keys})
    assert {name for _, name, _ in s} == set(keys)
    assert all(tier == "shared" for _, _, tier in s)


def _types(registry):
    C, G, H = prometheus_client.Counter, prometheus_client.Gauge, prometheus_client.Histogram

    class Counter(C):
        def __init__(self, *a, **k):
            super().__init__(*a, registry=registry, **k)

    class Gauge(G):
        def __init__(self, *a, **k):
            super().__init__(*a, registry=registry, **k)

    class Histogram(H):
        def __init__(self, *a, **k):
            super().__init__(*a, registry=registry, **k)

    return {C: Counter, G: Gauge, H: Histogram}


def test_prom_series_with_tier_label():
    reg = prometheus_client.CollectorRegistry()

    class Cfg:
        kv_transfer_config = None

    m = KVTierPromMetrics(Cfg(), _types(reg), ["model_name", "engine"], {0: ["tiny", "0"]}, tiers=["cpu", "nvme"])
    lab = {"model_name": "tiny", "engine": "0"}
    # every known tier's series exists at 0 before anything is counted
    assert reg.get_sample_value("vllm:kvtier_hit_blocks_total", {**lab, "tier": "nvme"}) == 0
    assert reg.get_sample_value("vllm:kvtier_io_errors_total", {**lab, "tier": "cpu"}) == 0
    m.observe({"hit_blocks.cpu": 4, "hit_blocks.nvme": 2, "n_lookups": 3, "gauge_resident_blocks.cpu": 9,
               "obs:seconds_loaded.cpu": [0.002, 0.2]})
    m.observe({"hit_blocks.cpu": 1, "gauge_resident_blocks.cpu": 6, "demoted_blocks.nvme": 5})
    assert reg.get_sample_value("vllm:kvtier_hit_blocks_total", {**lab, "tier": "cpu"}) == 5
    assert reg.get_sample_value("vllm:kvtier_hit_blocks_total", {**lab, "tier": "nvme"}) == 2
    assert reg.get_sample_value("vllm:kvtier_lookups_total", lab) == 3
    assert reg.get_sample_value("vllm:kvtier_resident_blocks", {**lab, "tier": "cpu"}) == 6
    assert reg.get_sample_value("vllm:kvtier_demoted_blocks_total", {**lab, "tier": "nvme"}) == 5
    assert reg.get_sample_value("vllm:kvtier_load_seconds_count", {**lab, "tier": "cpu"}) == 2
    assert reg.get_sample_value("vllm:kvtier_load_seconds_bucket", {**lab, "tier": "cpu", "le": "0.005"}) == 1


def test_prom_tenant_series_with_bounded_label():
    """Per-tenant counters and bytes held (YAML `tenants:`) carry a `tenant` label; past
    MAX_TENANT_LABELS values, a new tenant is counted as `other`."""
    from kvtier.connector import metrics as mm
    reg = prometheus_client.CollectorRegistry()

    class Cfg:
        kv_transfer_config = None

    m = KVTierPromMetrics(Cfg(), _types(reg), ["model_name", "engine"], {0: ["tiny", "0"]}, tiers=["cpu"])
    lab = {"model_name": "tiny", "engine": "0", "tier": "cpu"}
    assert to_series({"tenant_hit_blocks.cpu|a": 3, "gauge_tenant_bytes.cpu|a": 0, "tenant_bogus.cpu|a": 1}) == {
        ("counter", "tenant_hit_blocks", ("cpu", "a")): 3, ("gauge", "tenant_bytes", ("cpu", "a")): 0}
    m.observe({"tenant_hit_blocks.cpu|a": 3, "tenant_stored_blocks.cpu|a": 5, "tenant_evicted_blocks.cpu|b": 2,
               "gauge_tenant_bytes.cpu|a": 4096})
    m.observe({"tenant_hit_blocks.cpu|a": 1, "gauge_tenant_bytes.cpu|a": 8192})
    assert reg.get_sample_value("vllm:kvtier_tenant_hit_blocks_total", {**lab, "tenant": "a"}) == 4
    assert reg.get_sample_value("vllm:kvtier_tenant_stored_blocks_total", {**lab, "tenant": "a"}) == 5
    assert reg.get_sample_value("vllm:kvtier_tenant_evicted_blocks_total", {**lab, "tenant": "b"}) == 2
    assert reg.get_sample_value("vllm:kvtier_tenant_bytes", {**lab, "tenant": "a"}) == 8192
    for i in range(mm.MAX_TENANT_LABELS + 5):
        m.observe({f"tenant_hit_blocks.cpu|t{i}": 1})
    names = {s.labels["tenant"] for f in reg.collect() if f.name.startswith("vllm:kvtier_tenant_")
             for s in f.samples if "tenant" in s.labels}
    assert len(names) == mm.MAX_TENANT_LABELS and "other" in names
    assert reg.get_sample_value("vllm:kvtier_tenant_hit_blocks_total", {**lab, "tenant": "other"}) == 8
