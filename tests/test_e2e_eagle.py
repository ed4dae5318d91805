"""Speculative decoding with an EAGLE draft inside real vLLM (CPU build), kvtier mounted.

A tiny random Llama target and a tiny random `EagleLlamaForCausalLM` draft (one decoder layer,
the target's embeddings and head shared). The draft's layer has the target's KV spec, so vLLM puts
it in the target's one full-attention KV-cache group (3 layers: 2 target, 1 draft): kvtier stores
and loads the draft's KV with the target's, in the same block bytes.

What is compared: the target's greedy tokens (speculative decoding never changes them: the target
verifies every draft token) and the draft's proposals, recorded at vLLM's scheduler: they depend on
the draft's KV, so equal proposals show the draft's KV was served as computed (the draft is random,
nothing is accepted; corrupting only the draft layer's bytes in DRAM changes every prompt's
proposals and no target token).

The draft's last block: vLLM 0.32 annotates no KV-cache group as the draft's for a one-group model
(`KVCacheGroupSpec.is_eagle_group` is set only where vLLM splits layers into several groups), and
its own prefix cache then counts every group as the draft's (KVCacheCoordinator.__init__): a hit
drops its last block, since the draft's KV at the hit's last position was computed with the next
token of the request that stored it. kvtier applies the same rule (connector/groups.py
`served_groups`): every full block stored, a hit of a prompt of 6 blocks and 5 tokens is 5 blocks,
and a prompt that shares the 6 blocks and diverges after them gets the baseline's proposals too.
"""

from __future__ import annotations

import collections
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import vllm_util as U  # noqa: E402

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not U.vllm_available(), reason="vLLM not installed")]

MAX_TOKENS = 8
BLOCKS = 6                     # full blocks per prompt (and 5 tokens more)
N = 4                          # prompts


def build_tiny_eagle(path: Path, seed: int = 1, scale: float = 4.0) -> str:
    """A random EAGLE draft for `vllm_util.build_tiny_llama`: vLLM's `EagleLlamaForCausalLM`
    (fc over [embedding, target hidden], one Llama decoder layer without its input norm),
    embeddings and head taken from the target (absent from the checkpoint)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    path.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=2048,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    cfg.architectures = ["EagleLlamaForCausalLM"]
    cfg.save_pretrained(path)
    g = torch.Generator().manual_seed(seed)

    def w(o: int, i: int) -> torch.Tensor:
        return torch.randn(o, i, generator=g) * scale / i ** 0.5

    p = "layers.0."
    save_file({"fc.weight": w(64, 128),
               p + "self_attn.q_proj.weight": w(128, 64), p + "self_attn.k_proj.weight": w(64, 64),
               p + "self_attn.v_proj.weight": w(64, 64), p + "self_attn.o_proj.weight": w(64, 128),
               p + "mlp.gate_proj.weight": w(128, 64), p + "mlp.up_proj.weight": w(128, 64),
               p + "mlp.down_proj.weight": w(64, 128), p + "post_attention_layernorm.weight": torch.ones(64)},
              str(path / "model.safetensors"))
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    U.set_env()
    d = tmp_path_factory.mktemp("eagle")
    return U.build_tiny_llama(d / "target"), build_tiny_eagle(d / "draft")


@pytest.fixture(scope="module")
def prompts():
    ps = U.prompts(N, BLOCKS, seed=3)
    cut = BLOCKS * U.BLOCK       # siblings: the same 6 blocks, other tokens after them
    sib = [p[:cut] + [(t + 7) % 509 + 3 for t in p[cut:]] for p in ps]
    return ps, sib


def _llm(models, cfg=None, **kw):
    target, draft = models
    return U.make_llm(target, cfg, speculative_config={"method": "eagle", "model": draft,
                                                       "num_speculative_tokens": 2}, **kw)


def _drafts(llm) -> dict:
    """prompt -> the draft's proposals, step by step (vLLM's scheduler receives them)."""
    sch = llm.llm_engine.engine_core.engine_core.scheduler
    log: dict = collections.defaultdict(list)
    orig = sch.update_draft_token_ids

    def update(d):
        for rid, toks in zip(d.req_ids, d.draft_token_ids):
            r = sch.requests.get(rid)
            if r is not None and not r.is_finished() and not r.is_prefill_chunk:
                log[tuple(r.prompt_token_ids)].append(list(toks))
        return orig(d)

    sch.update_draft_token_ids = update
    return log


def _run(llm, log, ps):
    """(tokens, proposals per prompt) of one generate call."""
    log.clear()
    out = U.generate(llm, ps, MAX_TOKENS)
    drafts = [log[tuple(p)] for p in ps]
    assert all(drafts), "no draft proposals recorded: speculative decoding did not run"
    return out, drafts


@pytest.fixture(scope="module")
def baseline(models, prompts):
    """Without a connector, vLLM's prefix cache off: (tokens, proposals) of the prompts, the siblings."""
    ps, sib = prompts
    llm = _llm(models)
    try:
        log = _drafts(llm)
        return _run(llm, log, ps), _run(llm, log, sib)
    finally:
        U.shutdown(llm)


def _connectors():
    import kvtier.connector as C
    s = [c for c in C.live_connectors("scheduler") if c.sched is not None]
    w = [c for c in C.live_connectors("worker") if c.worker is not None and c.worker.layout is not None]
    assert len(s) == 1 and len(w) == 1
    return s[0], w[0]


def test_eagle_draft_served_from_cpu_then_nvme(models, prompts, baseline, tmp_path):
    from kvtier.connector.groups import Group, GroupKind
    ps, sib = prompts
    (base, base_drafts), (base_sib, base_sib_drafts) = baseline
    full, hit = N * BLOCKS, N * (BLOCKS - 1)
    nvme = tmp_path / "nvme"
    cfg = dict(cpu_capacity_blocks=256, nvme_path=str(nvme), nvme_capacity_blocks=512)
    llm = _llm(models, U.kvtier_config(nvme_write_lag_steps=0, **cfg))
    try:
        s, w = _connectors()
        kvc = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
        assert [g.is_eagle_group for g in kvc.kv_cache_groups] == [False]   # vLLM flags no group
        assert s.groups == [Group(0, GroupKind.FULL, U.BLOCK, eagle=True)] and s.hybrid   # every group a draft's
        assert len(w.worker.layout.names) == 3       # 2 target layers and the draft's, one block
        log = _drafts(llm)
        assert _run(llm, log, ps) == (base, base_drafts)                    # pass 1 stores
        t = dict(s.sched.totals)
        assert t.get("hit_tokens", 0) == 0 and t["stored_blocks.cpu"] == full and t["stored_blocks.nvme"] == full
        assert _run(llm, log, ps) == (base, base_drafts)                    # pass 2: kvtier's
        t = dict(s.sched.totals)
        # the prefix less the draft's last block, as vLLM's own cache: 5 blocks a prompt
        assert t["hit_tokens"] == hit * U.BLOCK and t["hit_blocks.cpu"] == hit
        assert w.worker.totals["blocks_loaded.cpu"] == hit
        # siblings share the 6 blocks and are served 5: tokens and proposals the baseline's
        assert _run(llm, log, sib) == (base_sib, base_sib_drafts)
        assert s.sched.totals["hit_tokens"] == 2 * hit * U.BLOCK
    finally:
        U.shutdown(llm)
    # a restart: from NVMe, the draft's KV too
    llm = _llm(models, U.kvtier_config(**cfg))
    try:
        s, w = _connectors()
        log = _drafts(llm)
        assert _run(llm, log, ps) == (base, base_drafts)
        t = dict(s.sched.totals)
        assert t["hit_tokens"] == hit * U.BLOCK and t["hit_blocks.nvme"] == hit and t.get("hit_blocks.cpu", 0) == 0
        # not vacuous: noise over the draft layer's bytes in DRAM (promoted there) changes every
        # prompt's proposals and no target token
        lay, g = w.worker.layout, torch.Generator().manual_seed(0)
        lo, hi = lay.offsets[2], lay.offsets[3]
        for p in w.worker.pools:
            rows = p.buffer.view(-1, lay.block_bytes)
            rows[:, lo:hi] = (torch.randn(rows.shape[0], (hi - lo) // 4, generator=g) * 3).view(torch.uint8)
        out, drafts = _run(llm, log, ps)
        assert s.sched.totals["hit_blocks.cpu"] == hit
        assert out == base and all(a != b for a, b in zip(drafts, base_drafts))
    finally:
        U.shutdown(llm)


def test_vllm_prefix_cache_drops_the_last_block(models, prompts, baseline):
    """vLLM's own prefix cache under EAGLE (no connector): every group counts as the draft's and a
    hit drops its last block: 5 blocks of a prompt of 6 blocks and 5 tokens, and a sibling that
    diverges after the 6 shared blocks gets proposals identical to a run without a cache."""
    ps, sib = prompts
    (base, base_drafts), (base_sib, base_sib_drafts) = baseline
    llm = _llm(models, enable_prefix_caching=True, disable_log_stats=False)
    try:
        log = _drafts(llm)

        def hits():
            return next(m.value for m in llm.get_metrics() if m.name == "vllm:prefix_cache_hits")

        assert _run(llm, log, ps) == (base, base_drafts)
        h = hits()
        assert _run(llm, log, ps) == (base, base_drafts)
        assert hits() - h == N * (BLOCKS - 1) * U.BLOCK
        assert _run(llm, log, sib) == (base_sib, base_sib_drafts)
    finally:
        U.shutdown(llm)
