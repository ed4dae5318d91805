"""Parallel-agnostic blocks in real vLLM (issue 37): a cache written at TP=1 serves TP=2 and
the other way round, through the NVMe tier and through redis-server; a flipped byte in one
part (the bytes of one KV head, which one TP=2 rank reads) is a miss for every reader. Runs
tests/topology_e2e.py in a subprocess (vLLM spawns its TP workers from __main__)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import vllm_util as U  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900),
              pytest.mark.skipif(not U.vllm_available(), reason="vLLM not installed"),
              pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                                 reason="TP=2 on the CPU backend binds one core per rank")]

AGNOSTIC = "parallel-agnostic blocks (canonical v1, 2 parts of 16384 B; parts "


def _run(tmp_path, capsys, *args) -> dict:
    script = os.path.join(os.path.dirname(__file__), "topology_e2e.py")
    p = subprocess.run([sys.executable, script, str(tmp_path), *args], capture_output=True, text=True, timeout=840)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-3000:])
    d = json.loads(p.stdout.strip().splitlines()[-1])
    with capsys.disabled():
        print(f"\n[kvtier e2e] topology {args[0]}: {json.dumps(d)}")
    return d


def _check(d: dict) -> None:
    clean = {"same_tokens": True, "corrupt": 0, "load_failed": 0, "hook_errors": 0}
    # TP=1 stores A's 12 blocks as two parts each; TP=2 loads all of them (12 x 32 tokens)
    assert d["tp1_writes_a"] == {**clean, "hits": 0, "stored": 12, "parts": AGNOSTIC + "0-1)"}
    assert d["fingerprint_has_tp"] is False
    # TP=2 (rank 0 reads part 0, rank 1 part 1) hits all of A, then stores B
    assert d["tp2_reads_a"] == {**clean, "hits": 384, "stored": 12, "parts": AGNOSTIC + "0-0)"}
    # TP=1 reads both parts TP=2's ranks wrote
    assert d["tp1_reads_b"] == {**clean, "hits": 384, "stored": 0, "parts": AGNOSTIC + "0-1)"}
    # part 1 flipped: whoever reads it (TP=2's rank 1, TP=1) finds the first prompt's 4 blocks corrupt
    for name in ("tp2_reads_flipped_a", "tp1_reads_flipped_b"):
        assert d[name]["same_tokens"] is True and d[name]["corrupt"] == 4 and d[name]["load_failed"] == 4, d[name]
        assert d[name]["stored"] == 4   # recomputed, stored again


def test_parallel_agnostic_topology_through_nvme(tmp_path, capsys):
    d = _run(tmp_path, capsys, "nvme")
    _check(d)
    assert d["files"] == ["data.0", "data.1"]   # one directory, one file per part, whatever tp


def test_parallel_agnostic_topology_hybrid_through_nvme(tmp_path, capsys):
    """Gemma-3 (full + sliding-window groups): each group's blocks cross TP sizes too."""
    d = _run(tmp_path, capsys, "nvme", "-", "gemma3")
    clean = {"same_tokens": True, "corrupt": 0, "load_failed": 0, "hook_errors": 0}
    # 3 prompts x 4 blocks x 2 groups stored; a hit loads the full group's 4 blocks and the window's 2
    assert d["tp1_writes_a"] == {**clean, "hits": 0, "stored": 24, "parts": AGNOSTIC + "0-1)"}
    assert d["tp2_reads_a"] == {**clean, "hits": 3 * 6 * 32, "stored": 24, "parts": AGNOSTIC + "0-0)"}
    assert d["tp1_reads_b"] == {**clean, "hits": 3 * 6 * 32, "stored": 0, "parts": AGNOSTIC + "0-1)"}
    for name in ("tp2_reads_flipped_a", "tp1_reads_flipped_b"):
        assert d[name]["same_tokens"] is True and d[name]["corrupt"] == 6 and d[name]["load_failed"] == 6, d[name]


def test_parallel_agnostic_topology_through_redis(tmp_path, capsys, redis_factory):
    server = redis_factory(maxmemory="64mb")
    d = _run(tmp_path, capsys, "shared", server.url)
    _check(d)
    assert d["flipped"] == 24   # A's and B's part-1 values
