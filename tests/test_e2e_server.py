"""kvtier in vLLM's real OpenAI-compatible server (`python -m vllm.entrypoints.openai.api_server`):
/metrics counts exactly the blocks kvtier served, the startup lines are in the server's log, and
SIGTERM flushes the NVMe write-back so that a restarted server serves the prompts from NVMe.

A tiny random Llama built at test time, token-id prompts on /v1/completions, prefix caching off
(vLLM's own cache would serve the second pass; with it off the second pass is kvtier's).
Every server runs in its own process group, on a free loopback port, and is killed at the end.
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

BLOCKS = 3            # full blocks per prompt: (len - 1) // 32 == 3 loadable blocks
N = 3
START_S = 240         # server start on a loaded 2-core machine (about 30 s idle)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return U.build_tiny_llama(tmp_path_factory.mktemp("tinyllama"))


def _wait_metric(srv, name, want, timeout_s=60.0, **labels) -> float:
    """Poll /metrics until `name{labels}` == want (stats reach the API server a step late) or time out."""
    t_end = time.monotonic() + timeout_s
    while True:
        v = S.metric(S.parse_metrics(srv.metrics_text()), name, **labels)
        if v == want or time.monotonic() > t_end:
            return v
        time.sleep(0.5)


def _kvtier(**extra) -> str:
    return S.kvtier_transfer_config(failure_policy="recompute", **extra)


def test_metrics_count_blocks_served(model_dir, tmp_path):
    srv = S.Server(model_dir, tmp_path / "server.log", _kvtier(cpu_capacity_blocks=64))
    try:
        srv.wait_ready(START_S)
        ps = U.prompts(N, BLOCKS, seed=11)
        first = [srv.complete(p)["choices"][0]["text"] for p in ps]
        assert _wait_metric(srv, "vllm:kvtier_stored_blocks_total", N * BLOCKS, tier="cpu") == N * BLOCKS
        m = S.parse_metrics(srv.metrics_text())
        assert S.metric(m, "vllm:kvtier_hit_blocks_total") == 0
        second = [srv.complete(p)["choices"][0]["text"] for p in ps]
        assert second == first
        hits = _wait_metric(srv, "vllm:kvtier_hit_blocks_total", N * BLOCKS, tier="cpu")
        m = S.parse_metrics(srv.metrics_text())
        assert hits == N * BLOCKS
        assert S.metric(m, "vllm:kvtier_hit_tokens_total", tier="cpu") == N * BLOCKS * U.BLOCK
        assert S.metric(m, "vllm:kvtier_loaded_blocks_total", tier="cpu") == N * BLOCKS
        assert S.metric(m, "vllm:kvtier_loaded_bytes_total", tier="cpu") > 0
        assert S.metric(m, "vllm:kvtier_loads_total") == N
        assert S.metric(m, "vllm:kvtier_lookups_total") >= 2 * N
        assert S.metric(m, "vllm:kvtier_load_seconds_count", tier="cpu") >= 1
        assert S.metric(m, "vllm:kvtier_capacity_blocks", tier="cpu") == 64
        assert S.metric(m, "vllm:kvtier_resident_blocks", tier="cpu") == N * BLOCKS
        assert S.metric(m, "vllm:kvtier_checksum_failures_total") == 0
        # vLLM's own split of cached prompt tokens: kvtier's CPU tier is "host"
        assert S.metric(m, "vllm:prompt_tokens_cached_by_source_total", source="host") == N * BLOCKS * U.BLOCK
        assert S.metric(m, "vllm:prompt_tokens_cached_by_source_total", source="disk") == 0
    finally:
        srv.stop()
    log = srv.log_path.read_text(errors="replace")
    assert "kvtier connector (scheduler) started: tiers cpu 64 blocks" in log, srv.tail()
    assert "kvtier connector (worker rank 0) started:" in log, srv.tail()


def test_sigterm_flushes_nvme_and_restart_serves_it(model_dir, tmp_path):
    """max_tokens=1: the last prompt's NVMe writes are still unreported when the server goes idle,
    so only the shutdown path (worker flush, report, scheduler commit, index close) indexes them."""
    d = str(tmp_path / "nvme")
    cfg = _kvtier(cpu_capacity_blocks=64, nvme_path=d, nvme_capacity_blocks=256)
    args = ["--shutdown-timeout", "30"]   # vLLM's default (0) SIGKILLs the engine at once
    ps = U.prompts(N, BLOCKS, seed=13)
    srv = S.Server(model_dir, tmp_path / "a.log", cfg, extra_args=args)
    try:
        srv.wait_ready(START_S)
        first = [srv.complete(p, max_tokens=1)["choices"][0]["text"] for p in ps]
        assert _wait_metric(srv, "vllm:kvtier_stored_blocks_total", N * BLOCKS, timeout_s=10, tier="cpu") == N * BLOCKS
        assert srv.wait_idle()
    finally:
        srv.stop()  # SIGTERM, then the process group is killed whatever happened
    log = srv.log_path.read_text(errors="replace")
    assert "kvtier connector (scheduler): shut down, index closed" in log, srv.tail()
    srv = S.Server(model_dir, tmp_path / "b.log", cfg, extra_args=args)
    try:
        srv.wait_ready(START_S)
        again = [srv.complete(p, max_tokens=1)["choices"][0]["text"] for p in ps]
        assert again == first
        hits = _wait_metric(srv, "vllm:kvtier_hit_blocks_total", N * BLOCKS, tier="nvme")
        m = S.parse_metrics(srv.metrics_text())
        assert hits == N * BLOCKS
        assert S.metric(m, "vllm:kvtier_hit_blocks_total", tier="cpu") == 0
        assert S.metric(m, "vllm:prompt_tokens_cached_by_source_total", source="disk") == N * BLOCKS * U.BLOCK
        assert S.metric(m, "vllm:kvtier_checksum_failures_total", tier="nvme") == 0
    finally:
        srv.stop()
    log = srv.log_path.read_text(errors="replace")
    assert f"{N * BLOCKS} restored from disk" in log, srv.tail()


def test_shipped_lazy_config_persists_an_idle_servers_prompt(model_dir, tmp_path):
    """The shipped vLLM stack (offload: lazy, prefix caching on): one prompt, then nothing. Its
    blocks stay in vLLM's pool, but kvtier writes them behind in steps of their own once the
    server is idle (has_pending_push_work), so a restart serves them from NVMe."""
    d = str(tmp_path / "nvme")
    cfg = _kvtier(config="gpu-cpu-nvme", cpu_capacity_blocks=64, nvme_path=d, nvme_capacity_blocks=256)
    p = U.prompts(1, BLOCKS, seed=17)[0]
    srv = S.Server(model_dir, tmp_path / "a.log", cfg, prefix_caching=True, extra_args=["--shutdown-timeout", "30"])
    try:
        srv.wait_ready(START_S)
        first = srv.complete(p, max_tokens=1)["choices"][0]["text"]
        # no other request: the write-behind runs in the engine's idle steps
        assert _wait_metric(srv, "vllm:kvtier_stored_blocks_total", BLOCKS, tier="nvme") == BLOCKS
    finally:
        srv.stop()
    srv = S.Server(model_dir, tmp_path / "b.log", cfg, prefix_caching=True, extra_args=["--shutdown-timeout", "30"])
    try:
        srv.wait_ready(START_S)
        assert srv.complete(p, max_tokens=1)["choices"][0]["text"] == first
        assert _wait_metric(srv, "vllm:kvtier_hit_blocks_total", BLOCKS, tier="nvme") == BLOCKS
    finally:
        srv.stop()


def test_metrics_as_child_of_multiconnector(model_dir, tmp_path):
    """Under MultiConnector the stats reach the API server keyed by class name and are rebuilt
    through vLLM's connector registry: unregistered, the first stats failed the request (500)
    and stopped the server."""
    import json

    child = json.loads(S.kvtier_transfer_config(cpu_capacity_blocks=64))
    cfg = json.dumps({"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                      "kv_connector_extra_config": {"connectors": [child]}})
    srv = S.Server(model_dir, tmp_path / "server.log", cfg)
    try:
        srv.wait_ready(START_S)
        ps = U.prompts(2, BLOCKS, seed=17)
        first = [srv.complete(p)["choices"][0]["text"] for p in ps]
        second = [srv.complete(p)["choices"][0]["text"] for p in ps]
        assert second == first
        assert _wait_metric(srv, "vllm:kvtier_hit_blocks_total", 2 * BLOCKS, tier="cpu") == 2 * BLOCKS
    finally:
        srv.stop()
