"""End to end inside real vLLM (CPU build): tokens with kvtier loads == tokens without.

One process (VLLM_ENABLE_V1_MULTIPROCESSING=0, uni executor), a tiny random Llama saved at test
time, prefix caching off so the second pass of the same prompts is served by kvtier.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import vllm_util as U  # noqa: E402

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not U.vllm_available(), reason="vLLM not installed")]

N_PROMPTS = 4
BLOCKS = 4
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    U.set_env()
    return U.build_tiny_llama(tmp_path_factory.mktemp("tinyllama"))


@pytest.fixture(scope="module")
def prompts():
    return U.prompts(N_PROMPTS, BLOCKS, seed=7)


@pytest.fixture(scope="module")
def baseline(model_dir, prompts):
    llm = U.make_llm(model_dir)
    out = U.generate(llm, prompts, MAX_TOKENS)
    U.shutdown(llm)
    return out


def _parts():
    import kvtier.connector as C
    s = [c for c in C.live_connectors("scheduler") if c.sched is not None]
    w = [c for c in C.live_connectors("worker") if c.worker is not None and c.worker.layout is not None]
    assert len(s) == 1 and len(w) == 1, (len(s), len(w))
    return s[0], w[0]


def _full_blocks(p):  # blocks a request may load: at least one token is left to compute
    return (len(p) - 1) // U.BLOCK


def test_second_pass_served_by_kvtier(model_dir, prompts, baseline):
    # the shipped YAML stack through kvtier.config, with an inline override of its capacity
    llm = U.make_llm(model_dir, U.kvtier_config(config="cpu-only", cpu_capacity_blocks=64))
    try:
        s, w = _parts()
        first = U.generate(llm, prompts, MAX_TOKENS)
        t1 = dict(s.sched.totals)
        assert t1.get("hit_tokens", 0) == 0
        # every full block computed in pass 1 was stored (prompt + generated tokens)
        stored = sum((len(p) + MAX_TOKENS - 1) // U.BLOCK for p in prompts)
        assert t1["stored_blocks.cpu"] == stored
        assert w.worker.totals["blocks_stored.cpu"] == stored

        second = U.generate(llm, prompts, MAX_TOKENS)
        t2 = s.sched.totals
        want = sum(_full_blocks(p) for p in prompts)
        assert t2["hit_blocks.cpu"] == want
        assert t2["hit_tokens"] == want * U.BLOCK
        assert w.worker.totals["blocks_loaded.cpu"] == want
        assert w.worker.totals["bytes_loaded.cpu"] == want * w.worker.layout.block_bytes
        assert first == baseline
        assert second == baseline
        assert s.sched.leases.pinned() == 0 and s.sched.pinned_blocks() == 0

        # the check is not vacuous: noise in the stored blocks changes the tokens
        assert w.worker.pools[0].num_slots == 64
        for p in w.worker.pools:
            p.buffer.copy_(_noise(p.buffer))
        noisy = U.generate(llm, prompts, MAX_TOKENS)
        assert noisy != baseline
    finally:
        U.shutdown(llm)


def _noise(buf):
    import torch
    g = torch.Generator().manual_seed(0)
    return (torch.randn(buf.numel() // 4, generator=g) * 3).view(torch.uint8)


def test_load_failure_recomputes(model_dir, prompts, baseline):
    llm = U.make_llm(model_dir, U.kvtier_config(cpu_capacity_blocks=64))
    try:
        s, w = _parts()
        assert U.generate(llm, prompts, MAX_TOKENS) == baseline
        w.worker.fail_loads = True
        out = U.generate(llm, prompts, MAX_TOKENS)
        assert out == baseline                       # vLLM recomputed the blocks we failed to load
        assert s.sched.totals.get("load_failed_requests", 0) == len(prompts)
        assert s.sched.leases.pinned() == 0 and s.sched.pinned_blocks() == 0
    finally:
        U.shutdown(llm)


@pytest.mark.parametrize("kvtier_first", [False, True], ids=["example-first", "kvtier-first"])
def test_multiconnector_sibling(model_dir, prompts, baseline, tmp_path, kvtier_first):
    """With vLLM's ExampleConnector as sibling. The first child with a hit is chosen; the
    other gets update_state_after_alloc(..., 0) and kvtier must let its leases go."""
    cfg = U.multi_config(str(tmp_path / "example"), kvtier_first=kvtier_first, cpu_capacity_blocks=64)
    llm = U.make_llm(model_dir, cfg)
    try:
        s, w = _parts()
        first = U.generate(llm, prompts, MAX_TOKENS)
        second = U.generate(llm, prompts, MAX_TOKENS)
        assert first == baseline and second == baseline
        t = s.sched.totals
        if kvtier_first:
            want = sum(_full_blocks(p) for p in prompts)
            assert t["hit_tokens"] == want * U.BLOCK
            assert w.worker.totals["blocks_loaded.cpu"] == want
        else:
            # ExampleConnector stored the prompts in pass 1 and is asked first, so it is chosen:
            # kvtier had hits (leases taken) but was passed 0 and released them.
            assert t.get("hit_tokens", 0) == 0
            assert t["n_leases_not_chosen"] == len(prompts)
        assert s.sched.leases.pinned() == 0 and s.sched.pinned_blocks() == 0
    finally:
        U.shutdown(llm)
