"""benchmarks/gpu/check.sh, the lent GPU machine's one command (issue 29, item 7): `--cpu` runs
its harness here (worker-side imports with vLLM blocked, every layout pair byte-exact through the
device copier, the store, load and preemption ordering probes on DeferredStreams, sensitive to a
missing wait, two ranks reporting one store in different steps, layer 0's share of a load's bytes)
and the GPU-only checks say they were skipped; without CUDA the plain command fails.
`layer_overlap` fails on the whole-staging load order (rows staged whole, then scattered layer by
layer: layer 0 waits for every layer's bytes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvtier.connector.device_copy import DeviceCopier

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "benchmarks" / "gpu" / "check.sh"
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
import check as gpu_check  # noqa: E402


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
    for name in ("imports_without_vllm", "layouts", "store_probe", "load_probe", "tp_reports", "preempt_probe",
                 "layer_overlap"):
        assert checks[name]["status"] == "PASS", (name, checks[name])
    # the two ranks' reports of one store in different steps: committed only with the second
    assert checks["tp_reports"]["steps"] == [[0], [1]] and checks["tp_reports"]["resident"] == [0, 3]
    for name in ("store_probe", "load_probe"):        # the probe saw the missing wait every time
        assert checks[name]["ordered"] == [True] * 3 and checks[name]["unordered"] == [False] * 3
    pre = checks["preempt_probe"]                     # settled by handle_preemptions, and seen when not
    assert pre["settled"] == [True] * 3 and pre["unsettled"] == [False] * 3 and pre["settle_waits"] == 3
    assert checks["layouts"]["failed"] == [] and checks["layouts"]["pairs"] == 64
    for name in ("two_registrations", "hook_wait", "scattered_copies", "kvikio", "gds_load"):
        assert checks[name]["status"] == "SKIP"
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("check ")]
    assert len(lines) == 12                           # one line per check


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_check_without_cuda_fails(tmp_path):
    r = _run(tmp_path=tmp_path)
    assert r.returncode == 2
    assert "no CUDA device" in r.stderr


class WholeStaging(DeviceCopier):
    """The load order before issue 36 item 3: a chunk's rows staged whole (one host->device copy
    per run of rows, every layer's bytes), then one scatter per layer."""

    def load_parts(self, parts):
        s = self.streams
        s.fence()
        events = []
        with s.side():
            chunks = self._chunks(parts)
            for c, (idx, runs) in enumerate(chunks):
                s.run(self._stage_rows, idx.numel(), runs)
                for li in range(len(self.flat)):
                    s.run(self._scatter, li, idx)
                    if c == len(chunks) - 1:
                        events.append(s.record())
        return events

    def _stage_rows(self, n, runs):
        st = self._stage(n)
        for host, i, r0, k in runs:
            st[i:i + k].copy_(host[r0:r0 + k])

    def _scatter(self, li, idx):
        f = self.flat[li]
        f.index_copy_(0, idx, self._stage(idx.numel())[:, self.offsets[li]:self.offsets[li + 1]].view(-1, *f.shape[1:]))


def test_layer_overlap_can_fail():
    """`layer_overlap` on CPU: the layer-major loads pass (layer 0 waits for about 1/80 of a load's
    bytes, in one chunk and in four); the whole-staging order fails it (one chunk: every layer's
    host->device bytes before layer 0's event; four: the first three chunks too)."""
    whole = gpu_check.layer0_wait(WholeStaging)
    assert whole["one_chunk"] > 0.5 and whole["chunks"] > 0.85
    now = gpu_check.layer0_wait()
    assert now["one_chunk"] <= 1 / 80 + 0.002 and now["chunks"] <= 1 / 80 + 0.002
    gpu_check.layer_overlap(False, WholeStaging)
    assert gpu_check.RESULTS["checks"]["layer_overlap"]["status"] == "FAIL"
    gpu_check.FAILED.clear()
    gpu_check.layer_overlap(False)
    assert gpu_check.RESULTS["checks"]["layer_overlap"]["status"] == "PASS"
