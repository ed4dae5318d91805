"""`kvtier demo` end to end (two real vLLM OpenAI servers, one restart), and its parts that need no vLLM.

The demo is deterministic: one request at a time, greedy, a fixed pool. Its run asserts the
exact per-request sources the README promises (pass 1 computed, pass 2 from vLLM's cache or
kvtier DRAM, after the restart from NVMe), identical outputs, and no process left behind.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtier.cli import demo as D

sys.path.insert(0, os.path.dirname(__file__))
import vllm_util as U  # noqa: E402

FULL = D.PROMPT_BLOCKS * D.BLOCK          # prompt tokens in full blocks: what a cache can serve
PROMPT = FULL + D.PROMPT_EXTRA


def _kvtier(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtier", *args], capture_output=True, text=True, **kw)


def _live(pgid: int) -> list[int]:
    """Processes of group `pgid` that are not zombies."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(stat[2]) == pgid and stat[0] != "Z":
            out.append(int(d))
    return out


@pytest.mark.vllm
@pytest.mark.skipif(not U.vllm_available(), reason="vLLM not installed")
def test_demo_end_to_end(tmp_path):
    d = tmp_path / "demo"
    p = _kvtier("demo", "--dir", str(d), "--json", timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout)
    assert r["ok"] and r["same_outputs"], r["lines"]
    assert r["tiers"] == ["cpu", "nvme"]
    passes = r["passes"]
    assert [x["prompt"] for x in passes["pass 1"]] == list(range(D.N_PROMPTS))
    assert [x["prompt"] for x in passes["pass 2"]] == list(reversed(range(D.N_PROMPTS)))
    for rows in passes.values():
        for x in rows:
            assert x["settled"] and x["prompt_tokens"] == PROMPT and x["ttft_s"] > 0, x
            assert len(x["output"]) == D.MAX_TOKENS
            assert x["vllm_cache"] + sum(x["tiers"].values()) + x["computed"] == PROMPT
    for x in passes["pass 1"]:  # new prompts: all computed
        assert (x["vllm_cache"], x["tiers"], x["computed"]) == (0, {"cpu": 0, "nvme": 0}, PROMPT), x
    for x in passes["pass 2"]:  # every full block from vLLM's cache or kvtier DRAM, none from NVMe
        assert x["vllm_cache"] + x["tiers"]["cpu"] == FULL and x["tiers"]["nvme"] == 0, x
    assert passes["pass 2"][0]["vllm_cache"] == FULL        # the last prompt sent is still in vLLM's pool
    assert passes["pass 2"][-1]["tiers"]["cpu"] == FULL     # the first one only in kvtier DRAM
    for x in passes["restart"]:  # both caches empty after the restart: every full block from NVMe
        assert (x["vllm_cache"], x["tiers"], x["computed"]) == (0, {"cpu": 0, "nvme": FULL}, D.PROMPT_EXTRA), x
    outputs = {name: {x["prompt"]: x["output"] for x in rows} for name, rows in passes.items()}
    assert outputs["pass 2"] == outputs["pass 1"] and outputs["restart"] == outputs["pass 1"]
    assert len({tuple(o) for o in outputs["pass 1"].values()}) > 1  # outputs depend on the prompt
    assert f"after the restart, NVMe served {D.N_PROMPTS * FULL} of {D.N_PROMPTS * PROMPT} prompt tokens" \
        in r["lines"][1]
    # nothing left running, and the files are where it says
    assert len(r["server_pgids"]) == 2 and all(_live(g) == [] for g in r["server_pgids"])
    assert r["dir"] == str(d) and (d / "model" / "config.json").is_file() and (d / "nvme").is_dir()
    for log in r["logs"]:
        assert "kvtier connector (scheduler): shut down, index closed" in Path(log).read_text(errors="replace")
    assert "restored from disk" in Path(r["logs"][1]).read_text(errors="replace")


@pytest.mark.vllm
@pytest.mark.skipif(not U.vllm_available(), reason="vLLM not installed")
def test_demo_ctrl_c_stops_the_server(tmp_path):
    """SIGINT (Ctrl-C) while the server starts: the demo stops its process group and exits 130."""
    d = tmp_path / "demo"
    D.build_model(d / "model")  # so the server starts at once
    (d / D.MARKER).touch()
    proc = subprocess.Popen([sys.executable, "-m", "kvtier", "demo", "--dir", str(d)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    t_end = time.monotonic() + 120
    server = []
    while not server and time.monotonic() < t_end and proc.poll() is None:
        server = [pid for pid in _children(proc.pid)]
        time.sleep(0.2)
    assert server, "the demo started no server"
    time.sleep(3)  # well into vLLM's start
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err, err
    assert _live(server[0]) == []  # the server was its group's leader (start_new_session)


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[1]) == pid:
                out.append(int(d))
    return out


# ---- parts, no vLLM ------------------------------------------------------------------------
def test_demo_refuses_a_directory_it_did_not_make(tmp_path):
    (tmp_path / "precious.txt").write_text("keep")
    p = _kvtier("demo", "--dir", str(tmp_path))
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0 and "is not a kvtier demo directory" in p.stderr, p.stderr
    assert (tmp_path / "precious.txt").read_text() == "keep" and not (tmp_path / D.MARKER).exists()


def test_demo_resets_only_its_own_leftovers(tmp_path):
    d = tmp_path / "demo"
    assert D._prepare_dir(d) == [] and (d / D.MARKER).is_file()
    (d / "nvme").mkdir()
    (d / "nvme" / "data").write_bytes(b"x")
    (d / "server-1.log").write_text("old")
    (d / "model").mkdir()
    (d / "model" / "config.json").write_text("{}")
    notes = D._prepare_dir(d)
    assert len(notes) == 1 and "removed the NVMe tier" in notes[0]
    assert not (d / "nvme").exists() and not (d / "server-1.log").exists()
    assert (d / "model" / "config.json").read_text() == "{}"  # the model is reused
    assert (d.stat().st_mode & 0o777) == 0o700


def test_demo_without_vllm_says_how_to_install(monkeypatch, capsys, tmp_path):
    from kvtier.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    assert main(["demo", "--dir", str(tmp_path / "d")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "scripts/setup demo" in err and "pip install vllm" in err, err
    assert not (tmp_path / "d").exists()


def test_metrics_rows_add_up():
    text = "\n".join([
        '# HELP vllm:request_success_total x',
        'vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 3.0',
        'vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 1.0',
        'vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 10.0',
        'vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 64.0',
        'vllm:kvtier_hit_tokens_total{engine="0",model_name="m",tier="cpu"} 32.0',
        'vllm:kvtier_hit_tokens_total{engine="0",model_name="m",tier="nvme"} 32.0',
        'vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 0.5',
    ])
    c = D.counters(D.parse_metrics(text))
    assert c["finished"] == 4 and c["local_compute"] == 10 and c["external_kv_transfer"] == 64
    assert c["local_cache_hit"] == 0 and c["tier:cpu"] == 32 and c["tier:nvme"] == 32 and c["ttft_sum"] == 0.5
