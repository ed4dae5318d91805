"""Lazy offload's write-behind in vLLM's real server when the clock jumps: every finished block
still reaches NVMe, SIGTERM (vLLM's --shutdown-timeout) writes what is queued, and a restarted
server serves every prompt from NVMe.

The clock kvtier's write-behind reads is patched in the server's processes (a `sitecustomize`
on PYTHONPATH): each read is 35 s after the one before, as if the engine stalled 35 s before
every read, right after the last request included.
"""

from __future__ import annotations

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import server_util as S  # noqa: E402
import vllm_util as U  # noqa: E402

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not U.vllm_available(), reason="vLLM not installed")]

START_S = 240
N, BLOCKS = 6, 5

# Installed before kvtier is imported: the modules whose `time` the write-behind reads (today's and
# earlier ones) get a clock that jumps 35 s at every read.
SITECUSTOMIZE = '''
import importlib.abc, importlib.util, sys, time as _time

class _JumpingClock:
    def __init__(self):
        self.reads = 0
    def monotonic(self):
        self.reads += 1
        return _time.monotonic() + 35.0 * self.reads
    def __getattr__(self, name):
        return getattr(_time, name)

_CLOCK = _JumpingClock()
_TARGETS = {"kvtier.connector.drain", "kvtier.connector.lazy_offload", "kvtier.connector.scheduler"}

class _Patch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _TARGETS:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        run = spec.loader.exec_module
        def exec_module(module):
            run(module)
            module.time = _CLOCK
        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, _Patch())
'''


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return U.build_tiny_llama(tmp_path_factory.mktemp("tinyllama"))


def test_clock_jumps_then_sigterm_every_finished_block_on_nvme(model_dir, tmp_path):
    """Was: the idle steps ended at the first jump, SIGTERM wrote nothing more (22 of 30 blocks
    hit after the restart) and nothing said so."""
    d = str(tmp_path / "nvme")
    # 2 blocks a step: the last prompts' blocks are written behind in idle steps (or at SIGTERM)
    cfg = S.kvtier_transfer_config(config="gpu-cpu-nvme", cpu_capacity_blocks=64, nvme_path=d,
                                   nvme_capacity_blocks=256, max_blocks_per_step=2)
    args = ["--shutdown-timeout", "30"]
    clock = tmp_path / "clock"
    clock.mkdir()
    (clock / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(clock), os.environ.get("PYTHONPATH")) if p)}
    ps = U.prompts(N, BLOCKS, seed=23)
    srv = S.Server(model_dir, tmp_path / "a.log", cfg, prefix_caching=True, extra_args=args, env=env)
    try:
        srv.wait_ready(START_S)
        first = [srv.complete(p, max_tokens=1)["choices"][0]["text"] for p in ps]
    finally:
        srv.stop()   # SIGTERM right after the last request
    log = srv.log_path.read_text(errors="replace")
    assert "kvtier connector (scheduler): shut down, index closed" in log, srv.tail()
    lines = [ln for ln in log.splitlines() if "kvtier: shutdown: write-behind" in ln]
    assert len(lines) == 1 and "no finished request's block left unwritten" in lines[0], srv.tail()
    srv = S.Server(model_dir, tmp_path / "b.log", cfg, prefix_caching=True, extra_args=args)
    try:
        srv.wait_ready(START_S)
        again = [srv.complete(p, max_tokens=1)["choices"][0]["text"] for p in ps]
        assert again == first
        t_end = time.monotonic() + 60   # stats reach the API server a step late
        while (hits := S.metric(S.parse_metrics(srv.metrics_text()), "vllm:kvtier_hit_blocks_total",
                                tier="nvme")) != N * BLOCKS and time.monotonic() < t_end:
            time.sleep(0.5)
        assert hits == N * BLOCKS
        m = S.parse_metrics(srv.metrics_text())
        assert S.metric(m, "vllm:kvtier_checksum_failures_total", tier="nvme") == 0
    finally:
        srv.stop()
