"""Tenants on one cache (YAML `tenants:`): quotas honoured by eviction, per-tenant counters,
the guaranteed share as a property, config errors, and `kvtier replay` / `workload` per tenant."""

import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvtier.cli.main import main
from kvtier.core.config import ConfigError, parse_config
from kvtier.core.keys import make_key
from kvtier.core.stack import TierStack
from kvtier.policies.base import RequestInfo


def stack(cap=10, quotas=None, tiers=None, policy="lru", demotion="write_through"):
    d = {"block_bytes": 4096, "block_tokens": 16, "writeback_bytes": 8192,
         "tiers": tiers or [{"name": "dram", "kind": "cpu", "capacity_blocks": cap}],
         "policy": {"eviction": policy, "demotion": demotion}}
    if quotas is not None:
        d["tenants"] = {"quotas": quotas}
    return TierStack.from_config(parse_config(d, check_env=False), with_data=False)


class Keys:
    """Disjoint keys per tenant (vLLM hashes a request's blocks with its cache_salt)."""

    def __init__(self):
        self.n = 0
        self.owner = {}

    def new(self, tenant, n):
        out = []
        for _ in range(n):
            self.n += 1
            k = make_key(self.n)
            self.owner[k] = tenant
            out.append(k)
        return out

    def held(self, tier):
        out = {}
        for k in tier.resident:
            out[self.owner[k]] = out.get(self.owner[k], 0) + 1
        return out


_rid = iter(range(1 << 62))


def put(s, keys, tenant):
    """A request's store (its own request id: lru orders a request's blocks by it)."""
    return s.put(keys, info=RequestInfo(keys=keys, tenant=tenant, request_id=f"r{next(_rid)}"))


def test_burst_takes_free_room_only_then_evicts_its_own():
    s, ks = stack(10, {"a": {"dram": "50%"}, "b": {"dram": "30%"}}), Keys()
    a = ks.new("a", 3)
    assert put(s, a, "a") == 3
    b = ks.new("b", 10)
    assert put(s, b, "b") == 10            # 7 free slots, then b (over its quota) evicts its own
    t = s.tiers[0]
    assert ks.held(t) == {"a": 3, "b": 7}
    assert all(k in t for k in a)          # a, under its quota, lost nothing to b's burst
    # lru within b, in vLLM's order: a request's deepest blocks leave first
    assert [k in t for k in b] == [True] * 4 + [False] * 3 + [True] * 3
    tot = s.ctrl.totals
    assert tot["tenant_stored_blocks.dram|b"] == 10 and tot["tenant_evicted_blocks.dram|b"] == 3
    assert "tenant_evicted_blocks.dram|a" not in tot


def test_under_quota_tenant_reclaims_from_the_borrower_then_evicts_its_own():
    s, ks = stack(10, {"a": {"dram": "50%"}, "b": {"dram": "30%"}}), Keys()
    a = ks.new("a", 3)
    put(s, a, "a")
    b = ks.new("b", 7)
    put(s, b, "b")                          # b borrows a's unused quota and the unassigned 20%
    a2 = ks.new("a", 2)
    put(s, a2, "a")                         # a within its quota: the borrower's oldest go
    t = s.tiers[0]
    assert ks.held(t) == {"a": 5, "b": 5}
    assert [k in t for k in b] == [True] * 5 + [False] * 2
    assert s.get(a[:1], info=RequestInfo(keys=a[:1], tenant="a")) == 1   # a hit: a[0] is now a's most recent
    a3 = ks.new("a", 1)
    put(s, a3, "a")                         # a at its quota: its own least recent goes, not b's
    assert ks.held(t) == {"a": 5, "b": 5}
    assert [k in t for k in a] == [True, True, False]   # lru (vLLM's order: a[2] was behind a[1])
    st_ = s.ctrl.stats()["tenants"]
    assert st_["a"]["dram"]["held_blocks"] == 5 and st_["a"]["dram"]["quota_blocks"] == 5
    assert st_["a"]["dram"]["hits"] == 1 and st_["b"]["dram"]["evicted"] == 2
    assert st_["other"]["dram"]["held_blocks"] == 0


def test_without_quotas_a_burst_evicts_everyone():
    """What the quotas change: the same traffic on today's stack leaves a with nothing."""
    s, ks = stack(10), Keys()
    a = ks.new("a", 5)
    put(s, a, "a")
    put(s, ks.new("b", 10), "b")
    assert ks.held(s.tiers[0]) == {"b": 10}


def test_unnamed_tenants_share_the_default_quota_as_other():
    s, ks = stack(10, {"a": {"dram": "40%"}, "default": {"dram": "40%"}}), Keys()
    put(s, ks.new("x", 4), "x")
    put(s, ks.new("y", 2), None)             # no tenant: also `other`
    # a takes the 4 free slots, takes back what `other` borrowed (6 held, 4 its quota: x's least
    # recent two), then, over its own quota, evicts its own
    put(s, ks.new("a", 10), "a")
    assert ks.held(s.tiers[0]) == {"x": 2, "y": 2, "a": 6}
    assert s.ctrl.stats()["tenants"]["other"]["dram"]["held_blocks"] == 4


@pytest.mark.parametrize("policy", ["lru", "arc", "s3fifo"])
def test_policy_orders_victims_within_a_tenant(policy):
    """A tenant's victims are its own policy's victims: the same as that policy on its blocks alone."""
    s, ks = stack(8, {"a": {"dram": "50%"}, "b": {"dram": "50%"}}, policy=policy), Keys()
    solo = stack(4, policy=policy)
    a = ks.new("a", 4)
    for st_ in (s, solo):
        put(st_, a[:2], "a")
        put(st_, a[2:], "a")
        st_.get(a[:1])
    put(s, ks.new("b", 4), "b")
    for i in range(3):
        extra = ks.new("a", 1)
        put(s, extra, "a")
        put(solo, extra, "a")
        assert {k for k in s.tiers[0].resident if ks.owner[k] == "a"} == set(solo.tiers[0].resident)


def held(s, ks):
    return [ks.held(t) for t in s.tiers]


TIERS2 = [{"name": "dram", "kind": "cpu", "capacity_blocks": 12}, {"name": "dram2", "kind": "cpu", "capacity_blocks": 20}]
QUOTAS = {"a": {"dram": "50%", "dram2": "30%"}, "b": {"dram": "25%", "dram2": "40%"}, "c": {"dram2": "10%"}}


def _store_or_hit(s, ks, mine: dict, who: str, op: str, n: int) -> list[dict]:
    """Tenant `who` stores n new blocks ("put", or a hit with nothing stored yet) or hits one of
    its earlier prefixes; returns what each tenant then holds per tier."""
    if op == "put" or not mine[who]:
        keys = ks.new(who, n)
        mine[who].append(keys)
        put(s, keys, who)
    else:
        keys = mine[who][n % len(mine[who])]
        s.get(keys, info=RequestInfo(keys=keys, tenant=who))
    return held(s, ks)


def _others_keep_their_share(now: list[dict], before: list[dict], quota: list[dict], who: str) -> None:
    """Every tenant but `who` holds, in each tier, at least min(its quota, what it held before)."""
    for t in range(2):
        for x in "abc":
            if x != who:
                assert now[t].get(x, 0) >= min(quota[t][x], before[t].get(x, 0)), (t, x, who, now, before)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.tuples(st.sampled_from("abc"), st.sampled_from(["put", "hit"]), st.integers(1, 14)),
                    min_size=1, max_size=40),
       policy=st.sampled_from(["lru", "arc", "s3fifo"]), demotion=st.sampled_from(["write_through", "write_back"]))
def test_no_tenant_is_pushed_below_its_guaranteed_share(ops, policy, demotion):
    """After any store or hit by one of tenants a, b, c, every other tenant still holds, in each
    tier, at least min(its quota, what it held before): another's traffic may take back what a
    tenant borrowed, never its guaranteed share. Counted from the tiers' contents."""
    s, ks = stack(quotas=QUOTAS, tiers=TIERS2, policy=policy, demotion=demotion), Keys()
    quota = [{"a": 6, "b": 3, "c": 0}, {"a": 6, "b": 8, "c": 2}]
    mine = {"a": [], "b": [], "c": []}
    before = held(s, ks)
    for who, op, n in ops:
        now = _store_or_hit(s, ks, mine, who, op, n)
        _others_keep_their_share(now, before, quota, who)
        before = now
        assert s.ctrl.pinned_blocks() == 0
    for t, tier in enumerate(s.tiers):   # the controller's accounts agree with the tier's contents
        split = s.ctrl.tenants.split[tier.name]
        assert {x: split.usage[i] for i, x in enumerate("abc") if split.usage[i]} == held(s, ks)[t]



SHARES = [{"a": .5, "b": .25, "c": 0}, {"a": .3, "b": .4, "c": .1}]   # QUOTAS as fractions


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.one_of(
           st.tuples(st.sampled_from("abc"), st.sampled_from(["put", "hit"]), st.integers(1, 14)),
           st.tuples(st.sampled_from([0, 1]), st.just("shrink"), st.integers(1, 20))), min_size=1, max_size=40),
       policy=st.sampled_from(["lru", "arc", "s3fifo"]), demotion=st.sampled_from(["write_through", "write_back"]))
def test_the_guaranteed_share_holds_across_resizes(ops, policy, demotion):
    """The property above with the workers' reports of smaller pools interleaved: the quotas
    follow each tier's capacity, no store or hit pushes another tenant below min(its quota now,
    what it held), and a tenant under its quota stores into the top tier up to it (taking it back
    from the borrowers)."""
    s, ks = stack(quotas=QUOTAS, tiers=TIERS2, policy=policy, demotion=demotion), Keys()
    mine = {"a": [], "b": [], "c": []}
    before = held(s, ks)
    for who, op, n in ops:
        if op == "shrink":
            shrink(s, who, n)
            before = held(s, ks)
            continue
        quota = [{x: int(f * t.capacity_blocks) for x, f in sh.items()} for sh, t in zip(SHARES, s.tiers)]
        now = _store_or_hit(s, ks, mine, who, op, n)
        _others_keep_their_share(now, before, quota, who)
        if op == "put":
            assert now[0].get(who, 0) >= min(quota[0][who], before[0].get(who, 0) + n), (who, n, now, before)
        before = now
        assert s.ctrl.pinned_blocks() == 0
    for t, tier in enumerate(s.tiers):
        split = s.ctrl.tenants.split[tier.name]
        assert split.quotas[:3] == [int(SHARES[t][x] * tier.capacity_blocks) for x in "abc"]
        assert {x: split.usage[i] for i, x in enumerate("abc") if split.usage[i]} == held(s, ks)[t]


# ---- config -------------------------------------------------------------------------------

def cfg(tenants, tiers=None):
    return {"block_bytes": 4096, "tiers": tiers or [{"name": "dram", "kind": "cpu", "capacity_blocks": 10}],
            "tenants": tenants}


@pytest.mark.parametrize("tenants,want", [
    ({"quotas": {"a": {"dram": "60%"}, "b": {"dram": "50%"}}},
     r"^<dict>: tenants.quotas: the shares of tier 'dram' sum to 110% \(at most 100%\)$"),
    ({"quotas": {"a": {"ssd": "10%"}}}, r"^<dict>: tenants.quotas.a.ssd: unknown tier 'ssd' \(tiers: g, dram\)$"),
    ({"quotas": {"a": {"g": "10%"}}}, r"^<dict>: tenants.quotas.a.g: quotas apply to cpu and nvme tiers, not a gpu"),
    ({"quotas": {"a": {"dram": "150%"}}}, r"tenants.quotas: a: a share must be between 0% and 100%"),
    ({"quotas": {"other": {"dram": "1%"}}}, r"tenants.quotas: 'other': a tenant name"),
    ({"quotas": {"a|b": {"dram": "1%"}}},
     r"^<dict>: tenants.quotas: 'a\|b': a tenant name is 1-64 characters of A-Z a-z 0-9 _ \. - other than 'other'$"),
    ({"quotas": {"x" * 65: {"dram": "1%"}}}, r"^<dict>: tenants.quotas: 'x{65}': a tenant name is 1-64"),
    ({"key": "request_id"}, r"tenants.key: must be 'cache_salt' or 'kv_transfer_params.<field>'"),
])
def test_config_errors_are_one_line(tenants, want):
    tiers = [{"name": "g", "kind": "gpu"}, {"name": "dram", "kind": "cpu", "capacity_blocks": 10}]
    with pytest.raises(ConfigError) as e:
        parse_config(cfg(tenants, tiers), check_env=False)
    msg = str(e.value).replace("<dict>: invalid configuration\n  ", "<dict>: ")
    assert "\n" not in msg
    import re
    assert re.search(want, msg), msg


def test_sizes_over_the_capacity_are_refused_when_built():
    c = parse_config(cfg({"quotas": {"a": {"dram": "24KiB"}, "b": {"dram": "20KiB"}}}), check_env=False)
    with pytest.raises(ConfigError, match=r"tenants.quotas: the quotas of tier 'dram' sum to 11 blocks, more than its 10"):
        TierStack.from_config(c, with_data=False)


def test_a_request_tenant_that_is_not_a_name_is_other_and_the_exposition_parses(caplog):
    """A request's tenant with `|`, quotes or a newline is counted as `other` (one log line, a
    counter per read): the Prometheus exposition keeps its labels (tier `dram`; tenants `a`, `other`)."""
    prometheus_client = pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families
    from types import SimpleNamespace as R
    from kvtier.connector.metrics import KVTierPromMetrics
    c = parse_config(cfg({"key": "kv_transfer_params.tenant", "quotas": {"a": {"dram": "50%"}}}), check_env=False)
    s, ks = TierStack.from_config(c, with_data=False), Keys()
    ten = s.ctrl.tenants
    for bad in ("a|b", 'x"}\ny', "a" * 65):
        who = ten.tenant_of(R(cache_salt=None, kv_transfer_params={"tenant": bad}))
        assert who is None and ten.label(who) == "other"
        put(s, ks.new(bad, 2), who)
    put(s, ks.new("a", 1), ten.tenant_of(R(cache_salt=None, kv_transfer_params={"tenant": "a"})))
    warned = [r for r in caplog.records if "is not a tenant name" in r.getMessage()]
    assert len(warned) == 1 and "kv_transfer_params.tenant" in warned[0].getMessage()
    assert s.ctrl.totals["tenant_not_a_name"] == 3

    reg = prometheus_client.CollectorRegistry()
    types = {}
    for base in (prometheus_client.Counter, prometheus_client.Gauge, prometheus_client.Histogram):
        types[base] = type(base.__name__, (base,), {"__init__": lambda self, *a, _b=base, **k: _b.__init__(
            self, *a, registry=reg, **k)})

    class Vcfg:
        kv_transfer_config = None

    m = KVTierPromMetrics(Vcfg(), types, ["model_name", "engine"], {0: ["tiny", "0"]}, tiers=["dram"])
    m.observe({**s.ctrl.totals, **ten.gauges()})
    fams = list(text_string_to_metric_families(prometheus_client.generate_latest(reg).decode()))
    got = {(f.name, sm.labels["tier"], sm.labels["tenant"]): sm.value for f in fams
           for sm in f.samples if "tenant" in sm.labels}
    assert got[("vllm:kvtier_tenant_stored_blocks", "dram", "other")] == 6
    assert got[("vllm:kvtier_tenant_stored_blocks", "dram", "a")] == 1
    assert {(t, who) for _, t, who in got} == {("dram", "other"), ("dram", "a")}


def test_quota_sizes_that_no_longer_fit_a_shrunk_tier_are_scaled_down(caplog):
    """Sizes are refused when the stack is built (above); when the workers' pool turns out
    smaller, they are scaled down to the room the shares leave: one warning, a counter."""
    s = stack(40, {"a": {"dram": "80KiB"}, "b": {"dram": "40KiB"}, "default": {"dram": "25%"}})   # 20, 10, 10
    shrink(s, 0, 20)
    shrink(s, 0, 16)
    q = s.ctrl.stats()["tenants"]
    assert [q[x]["dram"]["quota_blocks"] for x in ("a", "b", "other")] == [8, 4, 4]   # other: 25% of 16
    assert s.ctrl.totals["tenant_quotas_clamped.dram"] == 2
    assert len([r for r in caplog.records if "scaled down" in r.getMessage()]) == 1
    s.clear()                                         # fresh policies: the same quotas, no error
    assert [s.ctrl.stats()["tenants"][x]["dram"]["quota_blocks"] for x in ("a", "b", "other")] == [8, 4, 4]


def test_tenant_of_a_request():
    from types import SimpleNamespace as R
    s = stack(10, {"a": {"dram": "10%"}})
    assert s.ctrl.tenants.tenant_of(R(cache_salt="a", kv_transfer_params=None)) == "a"
    c = parse_config(cfg({"key": "kv_transfer_params.tenant", "quotas": {"a": {"dram": "10%"}}}), check_env=False)
    t = TierStack.from_config(c, with_data=False).ctrl.tenants
    assert t.tenant_of(R(cache_salt="zz", kv_transfer_params={"tenant": "a"})) == "a"
    assert t.tenant_of(R(cache_salt="zz", kv_transfer_params=None)) is None
    assert t.label("zz") == "other" and t.label("a") == "a"


# ---- replay and workload ------------------------------------------------------------------

def two_tenant_trace(tmp_path):
    tr = tmp_path / "t.jsonl"
    lines = []
    for i in range(4):        # steady: the same 3-block prefix + one unique block, 4 times
        lines.append({"timestamp": i, "input_length": 4 * 16, "output_length": 1, "hash_ids": [1, 2, 3, 100 + i],
                      "tenant": "steady", "block_tokens": 16})
        lines.append({"timestamp": i, "input_length": 8 * 16, "output_length": 1,   # burst: 8 new blocks each
                      "hash_ids": list(range(1000 + 10 * i, 1008 + 10 * i)), "tenant": "burst", "block_tokens": 16})
    tr.write_text("".join(json.dumps(x) + "\n" for x in lines))
    y = tmp_path / "c.yaml"
    y.write_text("block_bytes: 4096\nblock_tokens: 16\ntiers:\n  - {name: dram, kind: cpu, capacity_blocks: 8}\n"
                 "tenants:\n  quotas:\n    steady: {dram: 50%}\n    burst: {dram: 50%}\n")
    return tr, y


def test_replay_reports_per_tenant_with_exact_counts(tmp_path, capsys):
    tr, y = two_tenant_trace(tmp_path)

    def run(*extra):
        assert main(["replay", "--trace", str(tr), "-c", str(y), "--no-data", "--no-belady", "--json", "-q", *extra]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tenants"]
    q = run()
    # steady stores 4 blocks (its quota), then hits its 3-block prefix 3 times (one block left to compute)
    assert q["steady"]["block_refs"] == 16 and q["steady"]["hit_blocks"] == 9
    assert q["burst"]["block_refs"] == 32 and q["burst"]["hit_blocks"] == 0
    assert q["steady"]["tiers"]["dram"]["held_blocks"] == 4 and q["burst"]["tiers"]["dram"]["held_blocks"] == 4
    none = run("--no-tenants")   # without quotas each burst (the whole cache) evicts steady's prefix
    assert none["steady"]["hit_blocks"] == 0 and none["steady"]["tiers"] == {}


def test_workload_tenants_writes_the_tenant_field(tmp_path, capsys):
    out = tmp_path / "w.jsonl"
    assert main(["workload", "tenants", "--seed", "0", "-o", str(out)]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    by = {}
    for r in rows:
        by[r["tenant"]] = by.get(r["tenant"], 0) + 1
    assert by == {"steady": 1200, "burst": 1500}
    steady = {h for r in rows if r["tenant"] == "steady" for h in r["hash_ids"]}
    assert not steady & {h for r in rows if r["tenant"] == "burst" for h in r["hash_ids"]}
    ts = sorted(r["timestamp"] for r in rows if r["tenant"] == "burst")
    assert 0.3 * 600_000 <= ts[0] and ts[-1] <= 0.7 * 600_000 + 10_000   # the last repeat: 1-10 s later
    sent = {}
    for r in rows:
        if r["tenant"] == "burst":
            sent[r["hash_ids"][0]] = sent.get(r["hash_ids"][0], 0) + 1   # a document's first block
    assert set(sent.values()) == {2} and len(sent) == 750   # each document twice, then never again


def test_inspect_server_shows_each_tenant(tmp_path, monkeypatch, capsys):
    import os
    from kvtier.core.serving_stats import write_server_state
    monkeypatch.setenv("KVTIER_RUN_DIR", str(tmp_path / "run"))
    s, ks = stack(10, {"a": {"dram": "50%"}}), Keys()
    put(s, ks.new("a", 3), "a")
    put(s, ks.new("b", 9), "b")   # b, unnamed, is `other`: the free room, then its own
    tot = dict(s.ctrl.totals)
    write_server_state({"stopped": None, "config": "x.yaml", "geometry": {"block_tokens": 16, "block_bytes": 4096},
                        "tiers": [], "totals": tot, "tenants": s.ctrl.tenants.stats(tot)})
    assert main(["inspect", "--server", str(os.getpid())]) == 0
    out = capsys.readouterr().out
    assert "  tenant a: dram: held 3/5 quota (12.00 KiB) hits 0 stored 3 evicted 0" in out, out
    assert "  tenant other: dram: held 7/0 quota (28.00 KiB) hits 0 stored 9 evicted 2" in out, out


def test_plan_plans_each_tenant(tmp_path, capsys):
    """Each tenant's own curve; at its quota it is what replay with quotas measured (9 of 16)."""
    tr, y = two_tenant_trace(tmp_path)
    assert main(["plan", "--trace", str(tr), "-c", str(y), "--json", "--no-belady"]) == 0
    ten = json.loads(capsys.readouterr().out)["tenants"]
    assert ten["steady"]["block_refs"] == 16 and ten["steady"]["unique_blocks"] == 7
    assert ten["steady"]["quota_blocks"] == 4 and ten["steady"]["at_quota"] == pytest.approx(9 / 16)
    assert ten["burst"]["block_refs"] == 32 and ten["burst"]["at_top_tier"] == 0.0
    assert main(["plan", "--trace", str(tr), "-c", str(y), "--no-belady"]) == 0
    out = capsys.readouterr().out
    assert "tenant steady: 4 requests, 16 block refs, 7 unique blocks; alone:" in out
    assert "at its quota (4 blocks of dram) 56.2%" in out


def test_a_persistent_tier_that_opens_later_gets_its_quotas(tmp_path):
    """In vLLM the NVMe tier waits, closed, for the model's identity: its quotas apply once it opens."""
    from kvtier.core.builder import build_controller, build_tier, build_tiers
    c = parse_config({"block_bytes": 4096, "tiers": [
        {"name": "dram", "kind": "cpu", "capacity_blocks": 10},
        {"name": "nv", "kind": "nvme", "path": str(tmp_path / "nv"), "capacity_blocks": 20}],
        "tenants": {"quotas": {"a": {"dram": "50%", "nv": "40%"}}}}, check_env=False)
    tiers = build_tiers(c, "none", closed="waiting for the model's identity")
    ctrl = build_controller(c, tiers)
    assert list(ctrl.tenants.split) == ["dram"]
    ctrl.open_tier(1, build_tier(c, 1, "none"))
    assert ctrl.tenants.split["nv"].quotas == [8, 0]
    ctrl.close()


def test_the_cursor_walks_every_account_the_one_furthest_over_first():
    """A quota-blind walk (write-back cleaning ahead) sees every evictable block once, the
    tenant furthest over its quota first, and resumes after a block."""
    s, ks = stack(10, {"a": {"dram": "50%"}, "b": {"dram": "10%"}}), Keys()
    put(s, ks.new("a", 3), "a")
    put(s, ks.new("b", 4), "b")                     # b: 3 over its quota, a: 2 under
    t = s.tiers[0]
    walk = [v.block_id for v in t.iter_free_blocks()]
    assert sorted(walk) == sorted(t.resident.values())
    assert [ks.owner[t.key_at(x)] for x in walk] == ["b"] * 4 + ["a"] * 3
    assert [v.block_id for v in t.iter_free_blocks(walk[4])] == walk[5:]
    assert t.free_slots(5) == walk[:5]


def test_inspect_shows_each_tenant_from_a_serving_directory(tmp_path, capsys):
    """`kvtier inspect` reads the counters a serving connector left in its NVMe directory."""
    from kvtier.core.serving_stats import write_stats
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"block_bytes: 64KiB\ntiers:\n  - {{name: cpu, kind: cpu, capacity_blocks: 8}}\n"
                   f"  - {{name: nvme, kind: nvme, path: {tmp_path / 'nv'}, capacity_blocks: 32, io: posix}}\n"
                   "tenants:\n  quotas:\n    alice: {cpu: 50%, nvme: 25%}\n")
    assert main(["spill", "-n", "2", "-c", str(cfg), "-q"]) == 0
    write_stats(str(tmp_path / "nv"), {"hit_blocks.cpu": 3, "miss_blocks": 1, "tenant_hit_blocks.cpu|alice": 3,
                                       "tenant_stored_blocks.nvme|alice": 5, "tenant_evicted_blocks.cpu|other": 2})
    capsys.readouterr()
    assert main(["inspect", "-c", str(cfg), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tiers"][1]["serving"]["tenants"] == {
        "alice": {"cpu": {"hits": 3}, "nvme": {"stored": 5}}, "other": {"cpu": {"evicted": 2}}}
    assert main(["inspect", "-c", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "tenant alice: cpu: hits 3 stored 0 evicted 0; nvme: hits 0 stored 5 evicted 0" in out, out


# ---- a tier resized (the workers' first report) -------------------------------------------

def shrink(s, t, n):
    """The workers report their pool holds `n` slots of tier `t`: the scheduler's path
    (connector/worker.py reports `capacity`, the scheduler passes the report to `complete`)."""
    from kvtier.core.plan import ReportBuilder
    b = ReportBuilder(rank=0)
    b.capacity({t: n})
    s.ctrl.complete(b.take())


def test_quotas_follow_the_tier_when_the_workers_report_a_smaller_pool():
    """(j) TP = 2, `capacity: 50%`: the scheduler resolved the share against the machine (1000
    blocks), the workers' pool holds 32. The quotas follow: a's 50% is 16 blocks of 32, and a,
    under it, takes them back from `other` (which filled the tier) where stale quotas (500 each)
    left a nothing."""
    s, ks = stack(1000, {"a": {"dram": "50%"}, "default": {"dram": "50%"}}), Keys()
    shrink(s, 0, 32)
    t = s.tiers[0]
    assert t.capacity_blocks == 32
    assert put(s, ks.new("x", 40), "x") == 40          # other fills the tier (its last 32 held)
    assert put(s, ks.new("a", 16), "a") == 16
    assert ks.held(t) == {"x": 16, "a": 16}
    q = s.ctrl.stats()["tenants"]
    assert q["a"]["dram"]["quota_blocks"] == 16 and q["other"]["dram"]["quota_blocks"] == 16
