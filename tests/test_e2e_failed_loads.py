"""A block whose load failed is not offered again until it is rewritten, inside real vLLM (CPU
build): a hybrid model (tiny Gemma-3, two KV-cache groups: vLLM loads its hits asynchronously and
sends a request whose load failed back to the lookup) restarted on an NVMe tier whose every read
fails (`KVTIER_FAULT` read:EIO / read:EISDIR, tiers/io_engine.py). Each request finishes in a
bounded number of steps with vLLM's own tokens, each block fails once, and the recomputed blocks,
stored afresh, are served on the next pass."""

from __future__ import annotations

import os
import shutil
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import vllm_util as U  # noqa: E402

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not U.vllm_available(), reason="vLLM not installed")]

MAX_TOKENS = 4
PROMPTS, BLOCKS = 4, 6
HIT = 6 + 2          # blocks a hit loads: the full group's 6, the sliding group's window (2)
MAX_STEPS = 60       # a pass takes about a dozen steps; on a loop (the same hit offered again) it never ends


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    U.set_env()
    return U.build_tiny_gemma3(tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="module")
def prompts():
    return U.prompts(PROMPTS, BLOCKS, seed=11)


@pytest.fixture(scope="module")
def baseline(gemma, prompts):
    llm = U.make_llm(gemma)
    try:
        return U.generate(llm, prompts, MAX_TOKENS)
    finally:
        U.shutdown(llm)


def _config(d):
    return U.kvtier_config(cpu_capacity_blocks=256, nvme_path=str(d), nvme_capacity_blocks=512,
                           nvme_write_lag_steps=0, promote=False)


@pytest.fixture(scope="module")
def stored(gemma, prompts, baseline, tmp_path_factory):
    """An NVMe directory holding every block of the prompts (both groups)."""
    d = tmp_path_factory.mktemp("nvme") / "tier"
    llm = U.make_llm(gemma, _config(d))
    try:
        assert U.generate(llm, prompts, MAX_TOKENS) == baseline
        U.run_steps(llm, 3)
        s, _ = _parts()
        assert s.sched.totals["stored_blocks.nvme"] == PROMPTS * 2 * BLOCKS
    finally:
        U.shutdown(llm)
    return d


def _parts():
    import kvtier.connector as C
    s = [c for c in C.live_connectors("scheduler") if c.sched is not None]
    w = [c for c in C.live_connectors("worker") if c.worker is not None and c.worker.layout is not None]
    assert len(s) == 1 and len(w) == 1
    return s[0], w[0]


def _bounded_generate(llm, prompts, max_steps):
    """vLLM's tokens of each prompt, stepping the engine at most `max_steps` times: (tokens, steps)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
    eng = llm.llm_engine
    for i, p in enumerate(prompts):
        eng.add_request(f"b{i}", TokensPrompt(prompt_token_ids=p), sp)
    out: dict[str, list[int]] = {}
    steps = 0
    while eng.has_unfinished_requests():
        assert steps < max_steps, f"{len(prompts) - len(out)} requests unfinished after {steps} steps"
        steps += 1
        for o in eng.step():
            if o.finished:
                out[o.request_id] = list(o.outputs[0].token_ids)
    return [out[f"b{i}"] for i in range(len(prompts))], steps


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["EIO", "EISDIR"])
def test_hybrid_model_nvme_read_errors_are_not_offered_again(gemma, prompts, baseline, stored, tmp_path,
                                                             monkeypatch, capsys, kind):
    from kvtier.tiers.io_engine import HOOKS

    d = tmp_path / "tier"
    shutil.copytree(stored, d)                       # each kind on its own copy
    llm = U.make_llm(gemma, _config(d))
    try:
        s, w = _parts()
        assert s.hybrid
        monkeypatch.setattr(HOOKS, "counts", {})
        monkeypatch.setattr(HOOKS, "fault", ("read", kind, 1))   # every NVMe read fails
        out, steps = _bounded_generate(llm, prompts, MAX_STEPS)
        t, wt = dict(s.sched.totals), dict(w.worker.totals)
        with capsys.disabled():
            print(f"\n[kvtier e2e] hybrid, NVMe read:{kind}: {steps} steps, "
                  f"{wt.get('blocks_load_failed.nvme', 0)} blocks failed, "
                  f"{t.get('failed_load_blocks.nvme', 0)} remembered, "
                  f"{t.get('load_failed_requests', 0)} requests failed")
        assert out == baseline                                     # recomputed: vLLM's own tokens
        # each request's hit was offered once, each of its blocks failed once and is remembered
        assert t["hit_blocks.nvme"] == PROMPTS * HIT and t["load_failed_requests"] == PROMPTS
        assert wt["blocks_load_failed.nvme"] == t["failed_load_blocks.nvme"] == PROMPTS * HIT
        assert HOOKS.counts["read"] >= 1 and "blocks_loaded.nvme" not in wt
        # the recomputed blocks are stored afresh (DRAM): that rewrite forgets them; served next pass
        assert t["stored_blocks.cpu"] == PROMPTS * 2 * BLOCKS
        out2, _ = _bounded_generate(llm, prompts, MAX_STEPS)
        t2 = s.sched.totals
        assert out2 == baseline
        assert t2["hit_blocks.cpu"] == PROMPTS * HIT and t2["hit_blocks.nvme"] == PROMPTS * HIT
        assert w.worker.totals["blocks_loaded.cpu"] == PROMPTS * HIT
        assert s.sched.leases.pinned() == 0 and s.sched.pinned_blocks() == 0
    finally:
        monkeypatch.setattr(HOOKS, "fault", None)
        U.shutdown(llm)
