"""`kvtier replay` through the real stack: data and metadata-only agree exactly, bytes verified."""

import json

import pytest

from kvtier.cli.main import main


def run_json(capsys, *argv):
    rc = main(["replay", *argv, "--json", "-q"])
    assert rc == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def stack_yaml(tmp_path, policy="lru"):
    p = tmp_path / "s.yaml"
    p.write_text(f"""
block_bytes: 16KiB
tiers:
  - {{name: cpu, kind: cpu, capacity_blocks: 128}}
  - {{name: nvme, kind: nvme, path: {tmp_path}/nvme, capacity_blocks: 2048, io: posix}}
policy: {{eviction: {policy}}}
""")
    return str(p)


@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
def test_data_and_metadata_replays_agree(tmp_path, capsys, trace_path, policy):
    cfg = stack_yaml(tmp_path, policy)
    meta = run_json(capsys, "--trace", str(trace_path), "--config", cfg, "--limit", "300", "--no-data")
    data = run_json(capsys, "--trace", str(trace_path), "--config", cfg, "--limit", "300")
    assert data["data"] and not meta["data"]
    assert data["content_mismatches"] == 0
    for k in ("hit_blocks", "block_refs", "hit_tokens"):
        assert data[k] == meta[k], k
    for a, b in zip(data["per_tier"], meta["per_tier"]):
        assert (a["hit_blocks"], a["promoted_in"], a["demoted_in"], a["evicted"]) == \
               (b["hit_blocks"], b["promoted_in"], b["demoted_in"], b["evicted"])
    nv = data["per_tier"][1]
    assert nv["hit_blocks"] > 0 and nv["bytes_written"] == nv["demoted_in"] * 16384
    assert data["hit_blocks"] == sum(t["hit_blocks"] for t in data["per_tier"])
    assert 0 < data["hit_ratio"] <= data["belady_hit_ratio"] + 1e-9


def test_replay_starts_cold_unless_warm(tmp_path, capsys, trace_path):
    """A cold replay (the default) runs its NVMe tier in a scratch directory, removed after: it
    leaves nothing, so a second one gives the same result; a --warm run keeps its blocks in the
    configured path and the next --warm run's NVMe tier serves some of them."""
    cfg = stack_yaml(tmp_path)
    argv = ("--trace", str(trace_path), "--config", cfg, "--limit", "300", "--no-belady")
    first = run_json(capsys, *argv)
    assert first["start"] == {"warm": False, "blocks_held_at_open": {}}
    nd = first["nvme_data"]["nvme"]
    assert nd["removed"] and nd["path"].startswith(f"{tmp_path}/nvme/replay-scratch-") and nd["bytes_on_disk"] > 0
    assert not (tmp_path / "nvme").exists()   # created for the scratch directory, removed with it
    again = run_json(capsys, *argv)
    assert again["start"]["blocks_held_at_open"] == {}
    assert [t["hit_blocks"] for t in again["per_tier"]] == [t["hit_blocks"] for t in first["per_tier"]]
    warm1 = run_json(capsys, *argv, "--warm")
    assert warm1["start"] == {"warm": True, "blocks_held_at_open": {}} and warm1["hit_blocks"] == first["hit_blocks"]
    assert warm1["nvme_data"]["nvme"] == {"path": f"{tmp_path}/nvme", "removed": False,
                                          "bytes_on_disk": warm1["nvme_data"]["nvme"]["bytes_on_disk"]}
    left = warm1["per_tier"][1]["demoted_in"] - warm1["per_tier"][1]["evicted"]
    assert left > 0
    warm = run_json(capsys, *argv, "--warm")
    assert warm["start"] == {"warm": True, "blocks_held_at_open": {"nvme": left}}
    assert warm["per_tier"][1]["hit_blocks"] > first["per_tier"][1]["hit_blocks"]
    assert warm["content_mismatches"] == 0


def test_single_tier_matches_simulator(capsys, trace_path):
    from kvtier.offline.sim import simulate
    from kvtier.offline.trace import load_trace, unique_blocks
    reqs = load_trace(trace_path, limit=2000)
    d = run_json(capsys, "--trace", str(trace_path), "--limit", "2000", "--capacity-fraction", "0.05",
                 "--policy", "lru", "--no-data")
    assert d["per_tier"][0]["capacity_blocks"] == int(0.05 * unique_blocks(reqs))
    s = simulate(reqs, d["per_tier"][0]["capacity_blocks"], "lru", vllm=True)
    assert d["hit_blocks"] == s["hit_blocks"]
    assert set(d) >= {"hit_ratio", "token_hit_ratio", "belady_hit_ratio", "per_tier", "cost"}
    assert d["cost"]["mean_ttft_saved_ms"] > 0


def test_plot(tmp_path, capsys, trace_path):
    png = tmp_path / "hr.png"
    d = run_json(capsys, "--trace", str(trace_path), "--limit", "400", "--capacity-blocks", "50", "--no-data",
                 "--plot", str(png))
    assert png.stat().st_size > 10_000 and d["plot"] == str(png)


def test_bad_trace_line(tmp_path, capsys):
    t = tmp_path / "t.jsonl"
    t.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n{"timestamp": 1}\n')
    assert main(["replay", "--trace", str(t), "--no-data", "--capacity-blocks", "4"]) == 2
    err = capsys.readouterr().err
    assert "t.jsonl:2:" in err and "input_length" in err



@pytest.mark.parametrize("case", ["directory", "empty", "blank", "limit0", "limit-negative"])
def test_bad_replay_input_is_one_line(tmp_path, capsys, case):
    t = tmp_path / "t.jsonl"
    t.write_text({"blank": "\n\n"}.get(case, '{"timestamp": 0, "input_length": 10, "output_length": 1, '
                                              '"hash_ids": [1]}\n') if case != "empty" else "")
    args = {"directory": ["--trace", str(tmp_path)], "empty": ["--trace", str(t)], "blank": ["--trace", str(t)],
            "limit0": ["--trace", str(t), "--limit", "0"], "limit-negative": ["--trace", str(t), "--limit", "-5"]}
    assert main(["replay", *args[case], "--no-data", "--capacity-blocks", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    want = {"directory": "is a directory", "empty": "no requests", "blank": "no requests",
            "limit0": "--limit must be > 0, got 0", "limit-negative": "--limit must be > 0, got -5"}[case]
    assert len(err) == 1 and want in err[0], err


@pytest.mark.parametrize("line,want", [
    ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [99999999999999999999999]}',
     "'hash_ids'[0] must be an integer in [0, 2**64)"),
    ('{"timestamp": 1e999, "input_length": 600, "output_length": 1, "hash_ids": [1]}',
     "'timestamp' must be a finite non-negative number"),
])
def test_out_of_range_trace_values_are_one_line(tmp_path, capsys, line, want):
    t = tmp_path / "t.jsonl"
    t.write_text(line + "\n")
    assert main(["replay", "--trace", str(t), "--no-data", "--capacity-blocks", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "t.jsonl:1:" in err[0] and want in err[0], err


@pytest.mark.parametrize("args,want", [
    (["--load-gbps", "cpu=0"], "--load-gbps: 'cpu=0': the bandwidth must be a finite number > 0"),
    (["--prefill-tokens-per-s", "0"], "--prefill-tokens-per-s must be a finite number > 0"),
    (["--compare", "--capacity-blocks", "0"], "--capacity-blocks must be > 0, got 0"),
    (["--capacity-fraction", "nan"], "--capacity-fraction must be > 0, got nan"),
])
def test_bad_replay_numbers_are_one_line_before_any_work(tmp_path, capsys, trace_path, args, want):
    assert main(["replay", "--trace", str(trace_path), "--limit", "50", "--no-data", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and want in err[0], err

# Exact results of metadata replays (first 3000 requests), recorded before the replay fast paths:
# hit blocks, hit tokens, then per tier (hit blocks, promoted in, demoted in, evicted). Any change
# here means a policy, tier or stack change altered decisions, not just speed.
PINNED = {
    # issue 12: lru and s3fifo push a request's blocks tail-first as vLLM frees them; vllm_lru is
    # vLLM's block-pool order. Since the controller: replay offers what vLLM offers (full blocks,
    # >= 1 token computed); a dirty block never leaves in the plan that copies it down (clean-ahead
    # in take_plan). two-tier: lru over lru since nextuse was retired (recorded on the code before).
    "two-tier": [4423, 2264576, [3071, 1352, 0, 70489], [1352, 0, 69282, 67234]],
    "lru": [3071, 1572352, [3071, 0, 0, 74055]],
    "arc": [3545, 1815040, [3545, 0, 0, 73581]],
    "s3fifo": [3716, 1902592, [3716, 0, 0, 73410]],
    "vllm_lru": [3071, 1572352, [3071, 0, 0, 74055]],
}


@pytest.mark.parametrize("case", sorted(PINNED))
def test_replay_results_are_pinned(tmp_path, capsys, trace_path, case):
    if case == "two-tier":  # the shipped cpu-nvme shape (lru over lru, write-back), scaled down
        cfg = tmp_path / "s.yaml"
        cfg.write_text(f"""
block_bytes: 256KiB
tiers:
  - {{name: cpu, kind: cpu, capacity_blocks: 512}}
  - {{name: nvme, kind: nvme, path: {tmp_path}/nvme, capacity_blocks: 2048, eviction: lru}}
policy: {{eviction: lru, admission: all, promotion: inclusive, demotion: write_back}}
""")
        args = ["--config", str(cfg)]
    else:
        args = ["--capacity-blocks", "500", "--policy", case]
    d = run_json(capsys, "--trace", str(trace_path), "--limit", "3000", "--no-data", "--no-belady", *args)
    got = [d["hit_blocks"], d["hit_tokens"]] + [[t["hit_blocks"], t["promoted_in"], t["demoted_in"], t["evicted"]]
                                                 for t in d["per_tier"]]
    assert got == PINNED[case]
