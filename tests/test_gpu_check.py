"""benchmarks/gpu/check.sh, the lent GPU machine's one command (issue 29, item 7): `--cpu` runs
its harness here (worker-side imports with vLLM blocked, every layout pair byte-exact through the
device copier, the store, load and preemption ordering probes on DeferredStreams, sensitive to a
missing wait, two ranks reporting one store in different steps) and the GPU-only checks say they
were skipped; without CUDA the plain command fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "benchmarks" / "gpu" / "check.sh"


def _run(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable, TMPDIR=str(tmp_path))
    return subprocess.run(["bash", str(CHECK), *args], capture_output=True, text=True, timeout=900, env=env)


def test_check_cpu_passes_and_skips_the_gpu_checks(tmp_path):
    out = tmp_path / "figures.json"
    r = _run("--cpu", "--out", str(out), tmp_path=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    checks = res["checks"]
    assert res["mode"] == "cpu" and res["failed"] == []
    for name in ("imports_without_vllm", "layouts", "store_probe", "load_probe", "tp_reports", "preempt_probe"):
        assert checks[name]["status"] == "PASS", (name, checks[name])
    # the two ranks' reports of one store in different steps: committed only with the second
    assert checks["tp_reports"]["steps"] == [[0], [1]] and checks["tp_reports"]["resident"] == [0, 3]
    for name in ("store_probe", "load_probe"):        # the probe saw the missing wait every time
        assert checks[name]["ordered"] == [True] * 3 and checks[name]["unordered"] == [False] * 3
    pre = checks["preempt_probe"]                     # settled by handle_preemptions, and seen when not
    assert pre["settled"] == [True] * 3 and pre["unsettled"] == [False] * 3 and pre["settle_waits"] == 3
    assert checks["layouts"]["failed"] == [] and checks["layouts"]["pairs"] == 64
    for name in ("two_registrations", "hook_wait", "scattered_copies", "layer_overlap", "kvikio", "gds_load"):
        assert checks[name]["status"] == "SKIP"
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("check ")]
    assert len(lines) == 12                           # one line per check


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_check_without_cuda_fails(tmp_path):
    r = _run(tmp_path=tmp_path)
    assert r.returncode == 2
    assert "no CUDA device" in r.stderr
