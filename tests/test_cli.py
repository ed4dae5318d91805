"""The CLI end to end on real files: spill/restore/inspect/bench/replay."""

import json
import subprocess
import sys

import pytest

from kvtier.cli.main import main

BB = 65536


def write_cfg(tmp_path, cpu_blocks=8, nvme_blocks=256, policy="lru"):
    p = tmp_path / "stack.yaml"
    p.write_text(f"""
block_bytes: {BB}
tiers:
  - {{name: cpu, kind: cpu, capacity_blocks: {cpu_blocks}}}
  - {{name: nvme, kind: nvme, path: {tmp_path}/nvme, capacity_blocks: {nvme_blocks}, io: posix}}
policy: {{eviction: {policy}}}
""")
    return str(p)


def run_json(capsys, *argv):
    rc = main([*argv, "--json"])
    out = capsys.readouterr().out.strip().splitlines()[-1]
    return rc, json.loads(out)


def test_spill_restore_verify_exact(tmp_path, capsys):
    cfg = write_cfg(tmp_path)
    rc, s = run_json(capsys, "spill", "--config", cfg, "--blocks", "100", "--seed", "3")
    assert rc == 0 and s["blocks"] == 100 and s["nvme_resident"] == 100 and s["gbps"] > 0
    assert "posix" in s["engine"]
    rc, r = run_json(capsys, "restore", "--config", cfg, "--verify")  # seed from the manifest
    assert rc == 0
    assert (r["restored"], r["corrupt"], r["missing"], r["bad_served"], r["verified"]) == (100, 0, 0, 0, True)
    rc, r = run_json(capsys, "restore", "--config", cfg, "--verify", "--seed", "4")  # not this spill's seed
    assert rc == 1 and "wrong seed 4" in r["error"]["message"] and r["result"]["verified"] is False


def test_flipped_bytes_are_detected_not_served(tmp_path, capsys):
    cfg = write_cfg(tmp_path)
    run_json(capsys, "spill", "--config", cfg, "--blocks", "40", "--seed", "1")
    data = next((tmp_path / "nvme").rglob("data.0"))
    stride = 4096 + (BB + 4095) // 4096 * 4096   # header page + payload
    with open(data, "r+b") as f:
        for slot in (3, 17, 29):
            f.seek(slot * stride + 4096 + 1234)
            b = f.read(1)
            f.seek(slot * stride + 4096 + 1234)
            f.write(bytes([b[0] ^ 0xFF]))
    rc, r = run_json(capsys, "restore", "--config", cfg, "--verify", "--strict")
    r = r["result"]
    assert r["corrupt"] == 3 and r["restored"] == 37 and r["bad_served"] == 0
    assert rc == 1
    rc, r = run_json(capsys, "restore", "--config", cfg)  # read-only: nothing changed, still detected
    assert rc == 0 and r["index_entries"] == 40 and r["corrupt"] == 3 and r["restored"] == 37


def test_capacity_bound_on_spill(tmp_path, capsys):
    cfg = write_cfg(tmp_path, cpu_blocks=4, nvme_blocks=32)
    rc, s = run_json(capsys, "spill", "--config", cfg, "--blocks", "50", "--seed", "2")
    assert s["nvme_resident"] == 32 and s["evicted_from_nvme"] == 18
    rc, r = run_json(capsys, "restore", "--config", cfg, "--verify")
    assert (r["restored"], r["missing"], r["bad_served"]) == (32, 0, 0)


def test_inspect(tmp_path, capsys):
    cfg = write_cfg(tmp_path)
    run_json(capsys, "spill", "--config", cfg, "--blocks", "20")
    rc, d = run_json(capsys, "inspect", "--config", cfg)
    nv = [t for t in d["tiers"] if t["kind"] == "nvme"][0]
    assert nv["resident_blocks"] == 20 and nv["read_only"] is True
    assert nv["fingerprint"]["block_bytes"] == BB


def test_bad_config_exit_code(tmp_path, capsys):
    p = tmp_path / "bad.yaml"
    p.write_text("tiers: [{name: a, kind: cpu, capacity: huge}]")
    assert main(["inspect", "--config", str(p)]) == 2
    assert "tiers.0.capacity" in capsys.readouterr().err


def test_bench_small(tmp_path, capsys):
    rc, d = run_json(capsys, "bench", "--sizes", "256KiB", "--total", "16MiB", "--repeat", "1", "--dir", str(tmp_path))
    whats = {r["what"] for r in d["rows"]}
    assert {"cpu put", "cpu get", "nvme spill (write)", "nvme restore (read)"} <= whats
    assert all(r["ours_gbps"] > 0 and r["limit_gbps"] > 0 for r in d["rows"])


def test_module_entry_point(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kvtier", "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("kvtier ")


def test_inspect_shows_a_serving_schedulers_hit_ratios(tmp_path):
    """`kvtier inspect` reads the counters a serving connector leaves in its NVMe directory
    (serving-stats.json) without its lock, and shows hit ratios per tier."""
    import json
    import subprocess
    import sys
    from kvtier.core.serving_stats import write_stats
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"block_bytes: 64KiB\ntiers:\n  - {{name: cpu, kind: cpu, capacity_blocks: 8}}\n"
                   f"  - {{name: nvme, kind: nvme, path: {tmp_path / 'nv'}, capacity_blocks: 32, io: posix}}\n")
    run = lambda *a: subprocess.run([sys.executable, "-m", "kvtier", *a, "-c", str(cfg), "-q", "--json"],  # noqa: E731
                                    capture_output=True, text=True, timeout=120)
    assert run("spill", "-n", "4").returncode == 0
    assert "serving" not in json.loads(run("inspect").stdout)["tiers"][1]
    write_stats(str(tmp_path / "nv"), {"hit_blocks.cpu": 30, "hit_blocks.nvme": 10, "miss_blocks": 60,
                                       "n_lookups": 7})
    assert oct((tmp_path / "nv" / "serving-stats.json").stat().st_mode & 0o777) == "0o600"
    sv = json.loads(run("inspect").stdout)["tiers"][1]["serving"]
    assert (sv["blocks_looked_up"], sv["hit_ratio"], sv["hit_ratio_by_tier"], sv["lookups"]) == \
        (100, 0.4, {"cpu": 0.3, "nvme": 0.1}, 7)


@pytest.mark.parametrize("args,want", [(["--sizes", "0"], "--sizes: every block size must be > 0"),
                                       (["--sizes", "abc"], "--sizes: 'abc' is not a size"),
                                       (["--total", "1KiB"], "--total (1KiB) must hold at least one block"),
                                       (["--repeat", "0"], "--repeat must be >= 1")])
def test_bench_bad_arguments_are_one_line(tmp_path, capsys, args, want):
    assert main(["bench", *args, "--dir", str(tmp_path), "--skip-redis"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and want in err[0], err


# ---- issue 19: the smaller items ----------------------------------------------------------------
def kv(*args, cwd=None, env=None, timeout=300):
    import os
    e = dict(os.environ, **(env or {}))
    r = subprocess.run([sys.executable, "-m", "kvtier", *args], capture_output=True, text=True, timeout=timeout,
                       cwd=cwd, env=e)
    assert "Traceback" not in r.stderr, r.stderr
    return r


def test_bare_kvtier_prints_help_and_runs_nothing(tmp_path):
    r = kv(cwd=tmp_path)
    assert r.returncode == 2 and r.stdout == ""
    assert "usage: kvtier" in r.stderr and "replay" in r.stderr and "kvtier: error: no COMMAND given" in r.stderr
    assert list(tmp_path.iterdir()) == []                       # no replay ran: no ./kvtier-data
    assert "set -- replay" in (REPO / "scripts" / "run").read_text()   # scripts/run still runs replay


REPO = __import__("pathlib").Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("argv", [["spill", "--block", "100"], ["spill", "--see", "3", "-n", "1"],
                                  ["replay", "--capacity-block", "5", "--no-data"], ["--log", "INFO", "inspect"]])
def test_abbreviated_options_are_errors(tmp_path, capsys, argv):
    """`--block 100` was taken as `--blocks 100` (argparse's prefix matching): every parser refuses it."""
    cfg = write_cfg(tmp_path)
    with pytest.raises(SystemExit) as e:
        main([*argv, "--config", cfg] if argv[0] != "--log" else argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvtier: error:") and argv[1] in err[0], err
    assert not (tmp_path / "nvme").exists()


def test_default_log_level_prints_no_info_lines(tmp_path):
    cfg = write_cfg(tmp_path)
    r = kv("spill", "-c", cfg, "-n", "4")
    assert r.returncode == 0
    lines = r.stderr.splitlines()
    assert not [ln for ln in lines if ln.startswith("INFO") or ln.startswith("DEBUG")], lines
    assert [ln for ln in lines if ln.startswith("kvtier stack opened: cpu 8 blocks")]   # the one startup line
    assert "the one line a command prints when it opens" in " ".join(kv("--help").stdout.split())
    r = kv("spill", "-c", cfg, "-n", "4", "-q")
    assert r.returncode == 0 and r.stderr == ""
    r = kv("--log-level", "INFO", "spill", "-c", cfg, "-n", "4", "-q")
    assert [ln for ln in r.stderr.splitlines() if ln.startswith("INFO kvtier.nvme")]


def test_fsck_text_has_no_none(tmp_path, capsys):
    cfg = write_cfg(tmp_path)
    run_json(capsys, "spill", "--config", cfg, "--blocks", "5")
    assert main(["fsck", "--config", cfg]) == 0
    out = capsys.readouterr().out
    assert "None" not in out and "damaged: no: the index agrees with the block headers" in out
    assert "config_differs_in: none" in out


def test_wrong_seed_is_refused_before_any_figure(tmp_path, capsys):
    cfg = write_cfg(tmp_path)
    run_json(capsys, "spill", "--config", cfg, "--blocks", "10", "--seed", "3")
    assert main(["restore", "--config", cfg, "--verify", "--seed", "8", "-q"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == (f"kvtier: error: restore --verify: wrong seed 8: the manifest in "
                                         f"{tmp_path}/nvme lists the spills of seed 3")


def test_every_spills_blocks_stay_verifiable(tmp_path, capsys):
    """Two spills of two seeds: the manifest records both, `restore --verify` checks all 30
    blocks (each against its own seed), `--seed` picks one; a third spill that evicts some of
    them is counted and the manifest follows."""
    cfg = write_cfg(tmp_path, nvme_blocks=40)
    run_json(capsys, "spill", "--config", cfg, "--blocks", "20", "--seed", "3")
    run_json(capsys, "spill", "--config", cfg, "--blocks", "10", "--seed", "5")
    rc, r = run_json(capsys, "restore", "--config", cfg, "--verify")
    assert rc == 0 and (r["seeds"], r["verified_blocks"], r["expected"], r["unrecorded"]) == ([3, 5], 30, 30, 0)
    rc, r = run_json(capsys, "restore", "--config", cfg, "--verify", "--seed", "3")
    assert rc == 0 and (r["seeds"], r["verified_blocks"], r["missing"]) == ([3], 20, 0)
    rc, s = run_json(capsys, "spill", "--config", cfg, "--blocks", "25", "--seed", "6")   # evicts 15 of seed 3
    assert rc == 0 and (s["dropped"], s["evicted_earlier"]) == (0, 15)
    rc, r = run_json(capsys, "restore", "--config", cfg, "--verify")
    assert rc == 0 and (r["seeds"], r["verified_blocks"], r["missing"]) == ([3, 5, 6], 40, 0)
    rc, s = run_json(capsys, "spill", "--config", cfg, "--blocks", "10", "--seed", "5")   # same seed: replaced
    rc, r = run_json(capsys, "restore", "--config", cfg, "--verify", "--seed", "5")
    assert rc == 0 and r["verified_blocks"] == 10


def test_spill_beyond_capacity_reports_and_counts_the_dropped(tmp_path, capsys):
    cfg = write_cfg(tmp_path, cpu_blocks=4, nvme_blocks=32)
    assert main(["spill", "--config", cfg, "--blocks", "50", "-q"]) == 0
    out, err = capsys.readouterr()
    assert "on nvme: 32 of 50 (18 did not fit the tier's 32 blocks: evicted, oldest first)" in out
    rc, s = run_json(capsys, "spill", "--config", cfg, "--blocks", "50", "--seed", "1")
    assert (s["dropped"], s["nvme_resident"], s["capacity_blocks"], s["evicted_earlier"]) == (18, 32, 32, 32)
    assert s["metrics"]["evicted"]["nvme"] == 18 + 32


def test_inspect_says_what_a_connector_directory_was_written_under(tmp_path, capsys):
    """The YAML a server ran with, inspected: the tier's own block size and the connector's
    fingerprint from fingerprint.json, said plainly; no "hit ratio 0.0% ()" before any lookup."""
    from kvtier.core.builder import make_eviction
    from kvtier.core.config import load_config
    from kvtier.core.serving_stats import write_stats
    from kvtier.tiers.nvme import NvmeTier
    y = tmp_path / "srv.yaml"
    y.write_text(f"block_bytes: 256KiB\ntiers:\n  - {{name: cpu, kind: cpu, capacity: 64MiB}}\n"
                 f"  - {{name: nvme, kind: nvme, path: {tmp_path}/srv, capacity: 64MiB, io: posix}}\n")
    cfg = load_config(str(y), check_env=False).model_copy(update={"block_bytes": BB, "block_tokens": 16})
    fp = cfg.fingerprint(model="weights:abc", revision="None", dtype="torch.float32", kv_cache_dtype="auto",
                         layout="vllm-kv-blocks/cpu-packed-v1", tp=1, pp=1)    # what the connector records
    NvmeTier("nvme", f"{tmp_path}/srv", 64, BB, make_eviction(cfg, cfg.tiers[1], 64), io="posix",
             fingerprint=fp).close()
    write_stats(f"{tmp_path}/srv", {"n_lookups": 0})
    assert main(["inspect", "--config", str(y)]) == 0
    out = capsys.readouterr().out
    assert "block_bytes: 262144 (the config's)" in out and "blocks (0.0%) of 64.00 KiB" in out
    assert "written by the vLLM connector (model weights:abc, dtype torch.float32" in out
    assert "another fingerprint" not in out and "()" not in out and "no block looked up yet (0 lookups)" in out
    rc, d = run_json(capsys, "inspect", "--config", str(y))
    nv = d["tiers"][1]
    assert nv["block_bytes"] == BB and nv["fingerprint"]["model"] == "weights:abc"
    assert "model" in nv["config_differs_in"]
    write_stats(f"{tmp_path}/srv", {"n_lookups": 2, "miss_blocks": 4})
    assert main(["inspect", "--config", str(y)]) == 0
    assert "block hit ratio 0.0% (no hit in any tier) of 4 blocks looked up" in capsys.readouterr().out


def test_bench_leaves_no_data_directory(tmp_path):
    r = kv("bench", "--sizes", "64KiB", "--total", "1MiB", "--repeat", "1", "--skip-redis", "--skip-cpu", "--json",
           cwd=tmp_path, env={"KVTIER_DATA": ""})
    assert r.returncode == 0, r.stderr
    assert list(tmp_path.iterdir()) == []   # was an empty ./kvtier-data
    r = kv("bench", "--total", "100TiB", "--skip-redis", "--skip-cpu", cwd=tmp_path)
    assert r.returncode == 2 and "need" in r.stderr and list(tmp_path.iterdir()) == []


def test_replay_leaves_no_data_unless_warm(tmp_path):
    """Cold (the default, what scripts/run runs): the NVMe tier runs in a scratch directory in
    the configured path, removed after, with one line saying where and how big; an earlier
    spill's blocks there are untouched. --warm keeps its data and says so."""
    cfg = write_cfg(tmp_path, cpu_blocks=8, nvme_blocks=64)
    assert kv("spill", "-c", cfg, "-n", "10", "--seed", "4", "-q").returncode == 0
    before = sorted(p.name for p in (tmp_path / "nvme").iterdir())
    r = kv("replay", "-c", cfg, "--limit", "30", "--no-belady", "-q")
    assert r.returncode == 0, r.stderr
    line = [ln for ln in r.stderr.splitlines() if ln.startswith("replay: nvme tier 'nvme' ran in the scratch")]
    assert line and f"{tmp_path}/nvme/replay-scratch-" in line[0] and "on disk), now removed" in line[0]
    assert sorted(p.name for p in (tmp_path / "nvme").iterdir()) == before
    r = kv("restore", "-c", cfg, "--verify", "-q", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["verified_blocks"] == 10      # the spill is intact
    warm = write_cfg(tmp_path / "w" if (tmp_path / "w").mkdir() is None else None)
    r = kv("replay", "-c", warm, "--limit", "30", "--no-belady", "-q", "--warm", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["nvme_data"]["nvme"]["removed"] is False
    assert "keeps" in r.stderr and (tmp_path / "w" / "nvme" / "data.0").exists()


def test_replay_checks_dram_against_available_memory(tmp_path):
    import os
    below_physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") - (128 << 20)  # > available - headroom
    r = kv("replay", "--capacity-blocks", str(below_physical // 262144), "--limit", "5", "-q", cwd=tmp_path)
    assert r.returncode == 2 and "tier 'cpu': asks" in r.stderr and "available to it" in r.stderr
    r = kv("replay", "--limit", "5", "-q", cwd=tmp_path, env={"KVTIER_CPU_CAPACITY": "64TiB"})
    assert r.returncode == 2 and "tiers.0.capacity: tier 'cpu': asks 64.00 TiB of DRAM" in r.stderr
    assert list(tmp_path.iterdir()) == []
    r = kv("replay", "--limit", "5", "-q", "--no-data", "--no-belady", cwd=tmp_path,
           env={"KVTIER_CPU_CAPACITY": "64TiB"})   # metadata only, but ~256 B per block of capacity still
    assert r.returncode == 2 and "--no-data still keeps about 256 B per block of capacity" in r.stderr, r.stderr
    r = kv("replay", "--limit", "5", "-q", "--no-data", "--no-belady", cwd=tmp_path,
           env={"KVTIER_CPU_CAPACITY": "1TiB"})    # beyond this machine's DRAM: a metadata replay models it
    assert r.returncode == 0, r.stderr
