"""Tensor parallel 2 in real vLLM (two worker processes): each rank's NVMe shard in its own file,
restored after a restart, a flipped shard on one rank recomputed; tokens identical throughout.
Runs tests/tp_e2e.py in a subprocess (vLLM spawns its workers from __main__)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import vllm_util as U  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600),
              pytest.mark.skipif(not U.vllm_available(), reason="vLLM not installed"),
              pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                                 reason="TP=2 on the CPU backend binds one core per rank")]


def test_tp2_nvme_shards_restart_and_corruption(tmp_path, capsys):
    script = os.path.join(os.path.dirname(__file__), "tp_e2e.py")
    p = subprocess.run([sys.executable, script, str(tmp_path)], capture_output=True, text=True, timeout=540)
    assert p.returncode == 0, p.stderr[-3000:]
    d = json.loads(p.stdout.strip().splitlines()[-1])
    with capsys.disabled():
        print(f"\n[kvtier e2e] TP=2 (two worker processes): {json.dumps(d)}")
    assert d["parts"] == "parallel-agnostic blocks (canonical v1, 2 parts of 16384 B; parts 0-0)"
    assert d["pass1"] == {"same_tokens": True, "stored_cpu": 16, "stored_nvme": 16}
    assert d["files"] == ["data.0", "data.1"] and d["restored"] == 16 and d["rank_sums"] == 2
    assert d["pass2"] == {"same_tokens": True, "hits": {"cpu": 0, "nvme": 16 * U.BLOCK}, "corrupt": 0}
    assert d["pass3"]["same_tokens"] is True and d["pass3"]["corrupt"] == 1


def test_tp2_hybrid_model(tmp_path, capsys):
    """Gemma-3 (sliding window + full attention, vLLM's hybrid allocator on) at TP = 2: every
    group's blocks stored by each rank, served after a restart, a flipped shard recomputed."""
    script = os.path.join(os.path.dirname(__file__), "tp_e2e.py")
    p = subprocess.run([sys.executable, script, str(tmp_path), "gemma3"], capture_output=True, text=True,
                       timeout=540)
    assert p.returncode == 0, p.stderr[-3000:]
    d = json.loads(p.stdout.strip().splitlines()[-1])
    with capsys.disabled():
        print(f"\n[kvtier e2e] TP=2 hybrid (Gemma-3): {json.dumps(d)}")
    assert d["hma"] is True
    # every layer (full and sliding attention) certifies: parallel-agnostic (tests/test_e2e_topology.py)
    assert d["parts"] == "parallel-agnostic blocks (canonical v1, 2 parts of 16384 B; parts 0-0)"
    assert d["pass1"] == {"same_tokens": True, "stored_cpu": 4 * 12, "stored_nvme": 4 * 12}  # 6 blocks x 2 groups
    assert d["files"] == ["data.0", "data.1"] and d["restored"] == 4 * 12 and d["rank_sums"] == 2
    # the full group loads the prefix (6 blocks), the sliding group its window (2): hit blocks
    # counted per group, so the tokens they carry add up to (6 + 2) blocks' worth per prompt
    assert d["pass2"]["same_tokens"] is True and d["pass2"]["corrupt"] == 0
    assert d["pass2"]["hits"] == {"cpu": 0, "nvme": 4 * (6 + 2) * U.BLOCK}
    assert d["pass3"]["same_tokens"] is True and d["pass3"]["corrupt"] == 1
