"""The CLI end to end on real files: spill/restore/inspect/bench/replay."""

import json
import subprocess
import sys

import pytest

from kvtier.cli import main

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
    from kvtier.serving_stats import write_stats
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
