"""Counters are declared once (kvtier/common/counters.py `Metric`): every exported member is exactly one
Prometheus series with its help, no production module counts by a string literal, and counting
an undeclared name fails fast in tests."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvtier.core.plan import Counters
from kvtier.common.counters import COUNTER, GAUGE, HISTOGRAM, TENANT, TIER, Metric, declared

ROOT = Path(__file__).resolve().parents[1]
PRODUCTION = ["connector", "kvtier", "tiers", "policies"]
# files other helpers were editing when the counters became typed: their counting sites still use
# strings until they are converted; this set only shrinks
NOT_YET_TYPED: set[str] = set()


def test_members_are_unique_and_complete():
    assert len({m.key for m in Metric}) == len(Metric)
    assert all(m.help and m.help.endswith(".") for m in Metric), [m for m in Metric if not m.help]
    ex = Metric.exported()
    assert len({m.prom for m in ex}) == len(ex)
    assert all(m.prom for m in ex) and all(m.prom is None for m in Metric if m.export is None)
    assert all(m.key.startswith("gauge_") == (m.export == GAUGE) for m in Metric)
    assert all(m.per == TIER for m in Metric if m.export == HISTOGRAM)
    assert Metric.BYTES_STORED.at("cpu") == "bytes_stored.cpu" and Metric.N_LOOKUPS.key == "n_lookups"
    assert Metric.TENANT_HIT_BLOCKS.at("cpu", "a") == "tenant_hit_blocks.cpu|a"
    assert declared("obs:seconds_loaded.nvme") is Metric.SECONDS_LOADED and declared("bogus.cpu") is None


def test_every_exported_member_is_one_series_with_its_help():
    prometheus_client = pytest.importorskip("prometheus_client")
    pytest.importorskip("vllm")
    from kvtier.connector.metrics import PREFIX, KVTierPromMetrics
    reg = prometheus_client.CollectorRegistry()
    kinds = {}
    for base in (prometheus_client.Counter, prometheus_client.Gauge, prometheus_client.Histogram):
        kinds[base] = type(base.__name__, (base,), {
            "__init__": lambda self, *a, _b=base, **k: _b.__init__(self, *a, registry=reg, **k)})

    class Cfg:
        kv_transfer_config = None

    KVTierPromMetrics(Cfg(), kinds, ["model_name", "engine"], {0: ["tiny", "0"]}, tiers=["cpu"])
    families = [f for f in reg.collect() if f.name.startswith(PREFIX)]
    got = {f.name[len(PREFIX):]: f for f in families}
    assert len(got) == len(families)
    ex = Metric.exported()
    assert set(got) == {m.prom for m in ex}
    for m in ex:
        f = got[m.prom]
        assert f.documentation == m.help and f.type == {COUNTER: "counter", GAUGE: "gauge",
                                                         HISTOGRAM: "histogram"}[m.export], m
        labels = {s.name: set(s.labels) for s in f.samples}
        want = {TIER: {"tier"}, TENANT: {"tier", "tenant"}}.get(m.per, set()) | {"model_name", "engine"}
        assert all(ls >= want and ("tier" in ls) == ("tier" in want) for ls in labels.values()), (m, labels)


def _count_call_with_literal(path: Path) -> list[str]:
    out = []
    for n in ast.walk(ast.parse(path.read_text())):
        if not isinstance(n, ast.Call) or not n.args:
            continue
        f = n.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        a = n.args[0]
        if name.endswith("count") and (isinstance(a, ast.JoinedStr)
                                       or isinstance(a, ast.Constant) and isinstance(a.value, str)):
            out.append(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}:{n.lineno}: "
                       f"{ast.unparse(n)}")
    return out


def test_no_production_module_counts_by_a_string():
    """A counting site names a `Metric` member; `x.count("...")` or `x._count(f"...")` in
    production code is a counter nobody declared (kvtier/vllm's adapter events too)."""
    bad, seen = [], set()
    for top in PRODUCTION:
        for p in sorted((ROOT / top).rglob("*.py")):
            rel = str(p.relative_to(ROOT))
            if ".venv" in p.parts:
                continue
            hits = _count_call_with_literal(p)
            if rel in NOT_YET_TYPED:
                seen.add(rel) if hits else None
                continue
            bad += hits
    assert not bad, "count by a string (name a Metric member):\n" + "\n".join(bad)
    assert seen == NOT_YET_TYPED, f"now typed, drop from NOT_YET_TYPED: {sorted(NOT_YET_TYPED - seen)}"


def test_literal_finder_catches_each_form(tmp_path):
    p = tmp_path / "probe.py"
    p.write_text('a.count("x")\nb._count(f"y.{t}", 2)\nc.count(Metric.N_LOADS.key)\n"abc".count\nd.count(k)\n')
    assert [h.split(":")[1] for h in _count_call_with_literal(p)] == ["1", "2"]


def test_counting_an_undeclared_name_fails_fast():
    c = Counters()
    c.count(Metric.HIT_BLOCKS.at("cpu"), 2)
    c.count(Metric.N_LOOKUPS.key)
    with pytest.raises(KeyError, match="'hit_blcoks.cpu' is not declared"):
        c.count("hit_blcoks.cpu", 1)
    with pytest.raises(KeyError, match="not declared"):
        c.count("bogus")
    assert c.totals == {"hit_blocks.cpu": 2, "n_lookups": 1}
