"""`kvtier plan` and kvtier.offline.sizing: the one-pass LRU curve equals replay where the docs say so."""

from __future__ import annotations

import json
import tempfile

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvtier.cli.main import main
from kvtier.core.config import parse_config
from kvtier.offline.replay import replay
from kvtier.offline.sim import simulate
from kvtier.offline.sizing import capacity_grid, make_router, measure
from kvtier.core.stack import TierStack
from kvtier.offline.trace import Request, default_trace, load_trace, make_keys
from kvtier.offline.workloads import generate, write_trace


def R(*h, n=None, t=0.0):
    return Request(t, n if n is not None else 512 * len(h) + 1, 1, tuple(h))


def replay_tiers(reqs, tiers, demotion="write_through", bt=512):
    """Per-tier hit blocks of a metadata-only `kvtier replay` through the given tiers."""
    cfg = parse_config({"block_bytes": 4096, "block_tokens": bt, "tiers": tiers,
                        "policy": {"eviction": "lru", "promotion": "inclusive", "demotion": demotion}},
                       check_env=False)
    with TierStack.from_config(cfg, with_data=False) as stack:
        r = replay(stack, reqs)
    return [t["hit_blocks"] for t in r["per_tier"]], r


@pytest.fixture(scope="module")
def bundled():
    reqs = load_trace(default_trace(), limit=2000)
    return reqs, measure(reqs)


def test_curve_equals_replay_on_the_bundled_trace(bundled):
    reqs, sz = bundled
    assert sz.exact and sz.not_prefix == 0 and sz.capped_rerefs == 0
    u = sz.unique_blocks
    for cap in (1, 7, 60, 400, u // 100, u // 20, u // 10, u):
        s = simulate(reqs, cap, "lru", vllm=True)   # replay on one metadata-only lru tier
        assert round(sz.hit_blocks([cap])[0]) == s["hit_blocks"], cap
        assert sz.hit_ratio([cap])[0] == pytest.approx(s["hit_ratio"], abs=1e-12)
        tok = sz.hit_ratio([cap])[0] * sz.refs * 512 / sz.input_tokens
        assert tok == pytest.approx(s["token_hit_ratio"], abs=1e-12)


@pytest.mark.parametrize("shape,params", [("agent", {"sessions": 6}), ("chat", {"conversations": 400}),
                                          ("rag", {"requests": 800, "corpus": 300}), ("api", {"requests": 2000}),
                                          ("chat", {"conversations": 300, "block_tokens": 64})])
def test_curve_equals_replay_on_generated_workloads(shape, params):
    bt = params.get("block_tokens", 512)
    reqs = generate(shape, 1, **params)
    sz = measure(reqs, bt)
    assert sz.exact
    u = sz.unique_blocks
    for cap in (3, u // 50, u // 10, u // 3):
        s = simulate(reqs, max(1, cap), "lru", vllm=True, block_tokens=bt)
        assert round(sz.hit_blocks([max(1, cap)])[0]) == s["hit_blocks"], (shape, cap)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 9), st.integers(0, 3), st.integers(-1, 1)),
                min_size=1, max_size=40))
def test_curve_equals_replay_at_every_capacity(spec):
    """Random chained traces (conversations that grow, restart or branch): the curve is replay's hit
    count at every capacity, compactions of the Fenwick tree included."""
    reqs, convs = [], {}
    for conv, grow, branch, tail in spec:
        chain = convs.setdefault(conv, [conv * 1000])
        chain = chain[:max(1, len(chain) - branch)] + [conv * 1000 + 100 * branch + len(chain) + k * 7 + 1
                                                      for k in range(grow)]
        chain = list(dict.fromkeys(chain))
        convs[conv] = chain
        reqs.append(Request(0.0, 512 * len(chain) + (tail if tail >= 0 else -300), 1, tuple(chain)))
    sz = measure(reqs)
    if not sz.exact:   # a branch reused an id under another parent: the curve is a model then
        return
    for cap in range(1, sz.unique_blocks + 2):
        assert round(sz.hit_blocks([cap])[0]) == simulate(reqs, cap, "lru", vllm=True)["hit_blocks"], cap


def test_compaction_keeps_distances():
    """Thousands of requests over a small working set force many compactions; a naive stack agrees."""
    import random
    rnd = random.Random(3)
    reqs = [R(*(c * 100 + j for j in range(rnd.randrange(1, 6)))) for c in (rnd.randrange(40) for _ in range(5000))]
    sz = measure(reqs)
    stack: list[int] = []   # naive LRU stack in vLLM's order, most recent first
    want = {}
    for r in reqs:
        h = r.hash_ids
        m = 0
        for b in h:
            if b not in stack:
                break
            m = max(m, stack.index(b) + 1)
            want[m] = want.get(m, 0) + 1
        stack = list(h) + [b for b in stack if b not in h]
    hist = np.cumsum([want.get(i, 0) for i in range(sz.unique_blocks + 1)])
    assert [round(x) for x in sz.hit_blocks(range(1, sz.unique_blocks + 1))] == list(hist[1:])


def test_capped_rereference_and_non_prefix_are_flagged():
    # a block-aligned prompt re-sent: vLLM recomputes its last block, replay leaves it in place
    assert measure([R(1, 2, n=1024), R(1, 2, n=1024)]).capped_rerefs == 1
    assert not measure([R(1, 2, n=1024), R(1, 2, n=1024)]).exact
    assert measure([R(1, 2, n=1025), R(1, 2, n=1025)]).exact
    # a block seen under two parents: a cached block after a missing one
    sz = measure([R(1, 2), R(3, 2)])
    assert sz.not_prefix == 1 and not sz.exact


def test_two_tier_model_exact_where_stated(bundled):
    """Write-through, inclusive promotion: per-tier hits equal the inclusive model when the lower
    tier never evicts, and when it is no larger than the tier above (it then serves nothing)."""
    reqs, sz = bundled
    for c1, c2 in ((300, 10 * sz.unique_blocks), (2000, 10 * sz.unique_blocks), (3000, 2000)):
        got, _ = replay_tiers(reqs, [{"name": "cpu", "kind": "cpu", "capacity_blocks": c1},
                                     {"name": "nvme", "kind": "nvme", "path": tempfile.mkdtemp(), "capacity_blocks": c2}])
        h1, h2 = sz.hit_blocks([c1, max(c1, c2)])
        assert got == [round(h1), round(h2 - h1)], (c1, c2)


def test_write_back_lower_tier_between_inclusive_and_exclusive(bundled):
    """Write-back: the lower tier holds what the tier above evicted; on this trace its hits lie
    between the inclusive model (capacity C2) and the exclusive one (C1 + C2), as docs/sizing.md says."""
    reqs, sz = bundled
    c1, c2 = 2000, 6000
    got, _ = replay_tiers(reqs, [{"name": "cpu", "kind": "cpu", "capacity_blocks": c1},
                                 {"name": "nvme", "kind": "nvme", "path": tempfile.mkdtemp(), "capacity_blocks": c2}],
                          demotion="write_back")
    h1, h2, h12 = sz.hit_blocks([c1, c2, c1 + c2])
    assert got[0] == round(h1)
    assert round(h2 - h1) < got[1] < round(h12 - h1)


def test_fleet_with_an_unbounded_shared_tier_equals_a_fleet_replay(bundled):
    """N instances (one lru tier each) over one shared tier that holds everything: the fleet model's
    local and shared hits are those of N real stacks sharing one (metadata-only) shared tier."""
    from kvtier.core.builder import build_tiers
    reqs = bundled[0][:1000]
    n, cap = 3, 500
    for routing in ("random", "prefix"):
        sz = measure(reqs, instances=n, routing=routing, local_capacity=cap)
        cfg = parse_config({"block_bytes": 4096, "tiers": [{"name": "cpu", "kind": "cpu", "capacity_blocks": cap},
                                                           {"name": "shared", "kind": "redis"}]}, check_env=False)
        shared = build_tiers(cfg, "none")[1]
        stacks = []
        for _ in range(n):
            tiers = build_tiers(cfg, "none")
            stacks.append(TierStack(cfg, [tiers[0], shared], with_data=False))
        route = make_router(n, routing, 0)
        keys = make_keys(reqs)
        hits = [0, 0]
        skip = Request(0.0, 0, 0, ())
        for i, r in enumerate(reqs):
            # replay() names requests by their index: the earlier ones are passed as empty requests
            res = replay(stacks[route(r.hash_ids, min(len(r.hash_ids), r.input_length // 512))],
                         [skip] * i + [r], keys=[[]] * i + [keys[i]])
            hits[0] += res["per_tier"][0]["hit_blocks"]
            hits[1] += res["per_tier"][1]["hit_blocks"]
        assert hits[0] == round(sz.hit_blocks([cap])[0]), routing
        assert hits[1] == round(sz.hit_blocks([10 * sz.unique_blocks], shared=True)[0]), routing
        assert hits[1] > 0


def test_sampled_curve_within_the_stated_error(trace_path):
    reqs = load_trace(trace_path)
    exact, smp = measure(reqs), measure(reqs, sample=0.1)
    assert smp.sample_blocks >= 10_000 and 0 < smp.error() < 0.05
    grid = capacity_grid(exact.unique_blocks)
    grid = grid[grid >= smp.resolution()]
    assert np.abs(smp.hit_ratio(grid) - exact.hit_ratio(grid)).max() <= smp.error()
    assert abs(smp.unique_blocks - exact.unique_blocks) < 0.02 * exact.unique_blocks


def plan_json(capsys, *argv, rc=0):
    code = main(["plan", *argv, "--json", "-q"])
    out = capsys.readouterr().out.strip().splitlines()
    assert code == rc
    return json.loads(out[-1])


def test_plan_suggests_a_stack_that_reaches_the_target(tmp_path, capsys, trace_path):
    png = tmp_path / "plan.png"
    d = plan_json(capsys, "--trace", str(trace_path), "--limit", "1000", "--target-hit", "15%", "--png", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert d["method"]["exact_vs_replay"] and d["method"]["kind"] == "lru stack distances"
    assert [t["name"] for t in d["stack"]["tiers"]] == ["cpu", "nvme"] and len(d["per_tier"]) == 2
    assert all(b["hit_ratio"] >= b["lru_hit_ratio"] - 1e-9 for b in d["belady"])
    log = [p["hit_ratio"] for p in d["curve_log"]]
    assert len(log) > 40 and log == sorted(log) and d["curve_log"][-1]["capacity_blocks"] == d["unique_blocks"]
    s = d["suggestion"]
    assert s["hit_ratio"] >= 0.15
    # the suggested YAML loads, and one lru tier of its reach in replay reaches the target
    import yaml
    cfg = parse_config(yaml.safe_load(s["yaml"]), check_env=False)
    reach = max(t.blocks(cfg.block_bytes) for t in cfg.tiers)
    assert reach >= s["capacity_blocks"]
    reqs = load_trace(trace_path, limit=1000)
    assert simulate(reqs, s["capacity_blocks"], "lru", vllm=True)["hit_ratio"] >= 0.15
    assert simulate(reqs, s["capacity_blocks"] - 1, "lru", vllm=True)["hit_ratio"] < 0.15
    d = plan_json(capsys, "--trace", str(trace_path), "--limit", "1000", "--budget", "512MiB", "--no-belady",
                  "--instances", "3", "--routing", "prefix")
    assert d["fleet"]["instances"] == 3 and sum(d["fleet"]["requests_per_instance"]) == 1000
    assert d["suggestion"]["capacity_blocks"] == 2048 and "belady" not in d


@pytest.mark.parametrize("argv,words", [
    (["--sample", "0"], "--sample must be a rate in (0, 1]"),
    (["--target-hit", "1.5"], "--target-hit '1.5': must be between 0 and 1"),
    (["--target-hit", "0.99"], "no capacity reaches it"),
    (["--budget", "lots"], "--budget 'lots'"),
    (["--routing", "prefix"], "--routing needs --instances"),
    (["--instances", "0"], "--instances must be between 1 and 4096"),
    (["--png", "/nonexistent-dir/p.png"], "--png /nonexistent-dir/p.png: /nonexistent-dir: no such directory"),
])
def test_plan_bad_arguments_are_one_line(capsys, trace_path, argv, words):
    assert main(["plan", "--trace", str(trace_path), "--limit", "200", "--no-belady", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvtier: error: ") and words in err[0], err


def test_trace_block_tokens_is_read_and_used(tmp_path, capsys):
    reqs = generate("chat", 1, block_tokens=64, conversations=200)
    p = tmp_path / "t64.jsonl"
    write_trace(reqs, p, block_tokens=64)
    t = load_trace(p)
    assert t.block_tokens == 64 and list(t) == reqs
    d = plan_json(capsys, "--trace", str(p), "--no-belady", "--config", "cpu-only")
    assert d["block_tokens"] == 64 and d["block_bytes"] == 32768   # 256 KiB per 512 tokens, per 64
    cap = 500
    s = simulate(reqs, cap, "lru", vllm=True, block_tokens=64)
    assert main(["replay", "--trace", str(p), "--capacity-blocks", str(cap), "--no-data", "--no-belady",
                 "--json", "-q"]) == 0
    out = capsys.readouterr()
    r = json.loads(out.out.strip().splitlines()[-1])
    assert r["block_tokens"] == 64 and r["hit_blocks"] == s["hit_blocks"] and r["hit_tokens"] == s["hit_tokens"]
    assert "sizing in 64-token blocks" in out.err
    # every line of a trace has the same block size: a mismatch is one line naming both lines
    lines = p.read_text().splitlines()
    lines[5] = lines[5].replace('"block_tokens": 64', '"block_tokens": 16')
    p.write_text("\n".join(lines) + "\n")
    assert main(["plan", "--trace", str(p), "--no-belady"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and ":6: block_tokens 16, but line 1 has block_tokens 64" in err[0], err
    lines[5] = lines[5].replace(', "block_tokens": 16', "")
    p.write_text("\n".join(lines) + "\n")
    assert main(["replay", "--trace", str(p), "--no-data", "--capacity-blocks", "9"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and ":6: no block_tokens (512), but line 1 has block_tokens 64" in err[0], err


def test_plan_text_output(capsys, trace_path):
    assert main(["plan", "--trace", str(trace_path), "--limit", "800", "--budget", "256MiB"]) == 0
    out = capsys.readouterr().out
    assert "exact (equals `kvtier replay`" in out and "write-back: up to" in out and "Belady" in out
    assert "suggestion (budget 256.00 MiB of DRAM): cpu 256.00 MiB" in out and "capacity: 256MiB" in out
    assert main(["plan", "--trace", str(trace_path), "--limit", "800", "--sample", "0.5", "--instances", "2",
                 "-c", "cpu-nvme-redis"]) == 0
    out = capsys.readouterr().out
    assert "SHARDS sample at rate 0.5" in out and "fleet: 2 instances, random routing" in out
    assert "shared tier shared at" in out and "warning: the sample holds" in out
