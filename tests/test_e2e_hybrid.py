"""Hybrid models inside real vLLM (CPU build), kvtier mounted as a `SupportsHMA` connector: vLLM keeps
its hybrid KV-cache manager on, and kvtier serves every group with tokens identical to a run
without it.

- a Gemma-3-style model (sliding window 64 on every other layer: two groups, full and sliding);
- a Qwen3-Next-style model (gated delta net + attention: a Mamba-state group and a full group;
  vLLM's "align" mode needs prefix caching on, so its second pass drops vLLM's cache first);
- a DeepSeek-V2-style MLA model (one group: the path of every one-group model).
"""

from __future__ import annotations

import os
import random
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import vllm_util as U  # noqa: E402

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not U.vllm_available(), reason="vLLM not installed")]

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    U.set_env()
    return U.build_tiny_gemma3(tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="module")
def gemma_prompts():
    return U.prompts(4, 6, seed=3)      # 6 blocks of 32 and 5 tokens: the window needs 2 blocks


@pytest.fixture(scope="module")
def gemma_baseline(gemma, gemma_prompts):
    llm = U.make_llm(gemma)
    out = U.generate(llm, gemma_prompts, MAX_TOKENS)
    U.shutdown(llm)
    return out


def _sched():
    import kvtier.connector as C
    s = [c for c in C.live_connectors("scheduler") if c.sched is not None]
    w = [c for c in C.live_connectors("worker") if c.worker is not None and c.worker.layout is not None]
    assert len(s) == 1 and len(w) == 1
    return s[0], w[0]


def _hma_on(llm) -> bool:
    return llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False


def test_sliding_window_model_keeps_hma_and_is_served(gemma, gemma_prompts, gemma_baseline, tmp_path):
    from kvtier.connector.groups import GroupKind
    nvme = tmp_path / "nvme"
    llm = U.make_llm(gemma, U.kvtier_config(cpu_capacity_blocks=256, nvme_path=str(nvme), nvme_capacity_blocks=512,
                                            nvme_write_lag_steps=0))
    try:
        s, w = _sched()
        assert _hma_on(llm)
        assert [g.kind for g in s.groups] == [GroupKind.SLIDING, GroupKind.FULL] and s.hybrid
        assert U.generate(llm, gemma_prompts, MAX_TOKENS) == gemma_baseline
        t1 = dict(s.sched.totals)
        assert t1.get("hit_tokens", 0) == 0 and t1["stored_blocks.cpu"] == 4 * 12   # 6 full blocks x 2 groups
        assert U.generate(llm, gemma_prompts, MAX_TOKENS) == gemma_baseline         # served by kvtier
        t2 = s.sched.totals
        assert t2["hit_tokens"] == 4 * 6 * U.BLOCK
        # the full group loads the prefix (6 blocks), the sliding group only its window (2)
        assert t2["hit_blocks.cpu"] == 4 * (6 + 2)
        assert w.worker.totals["blocks_loaded.cpu"] == 4 * 8
        # not vacuous: noise in DRAM changes the tokens
        g = torch.Generator().manual_seed(0)
        for p in w.worker.pools:
            p.buffer.copy_((torch.randn(p.buffer.numel() // 4, generator=g) * 3).view(torch.uint8))
        assert U.generate(llm, gemma_prompts, MAX_TOKENS) != gemma_baseline
    finally:
        U.shutdown(llm)
    # a restart: every group's blocks from NVMe; one sliding-window block flipped on disk is a
    # checksum failure, recomputed: tokens identical
    from kvtier.tiers.nvme_block import HEADER_BYTES, slot_stride
    from kvtier.tiers.nvme_index import NvmeIndex
    idx = NvmeIndex(str(nvme / "index"), 512)
    entries = list(idx.items())
    idx.close()
    swa = [e for k, e in entries if k.endswith(b"\0\0\0\0")]
    assert len(swa) == 4 * 6 and len(entries) == 4 * 12
    victim = max(swa, key=lambda e: e.generation)   # the last prompt's, in its window
    with open(nvme / "data.0", "r+b") as f:
        f.seek(victim.slot * slot_stride(victim.length) + HEADER_BYTES + 64)
        b = f.read(8)
        f.seek(victim.slot * slot_stride(victim.length) + HEADER_BYTES + 64)
        f.write(bytes(x ^ 0xFF for x in b))
    llm = U.make_llm(gemma, U.kvtier_config(cpu_capacity_blocks=256, nvme_path=str(nvme), nvme_capacity_blocks=512))
    try:
        s, w = _sched()
        assert U.generate(llm, gemma_prompts, MAX_TOKENS) == gemma_baseline
        t = s.sched.totals
        # the corrupt block fails its request's load (vLLM takes a hybrid model's failures per
        # request): it is recomputed, asks again and is served 5 blocks (the window of 160 tokens
        # holds no bad block): 5 full + 2 sliding
        assert t["corrupt_blocks.nvme"] == 1 and t["load_failed_requests"] == 1
        assert t["hit_blocks.nvme"] + t.get("hit_blocks.cpu", 0) == 4 * 8 + 7
        assert t["hit_tokens"] == 4 * 6 * U.BLOCK + 5 * U.BLOCK   # the failed plan counted too
        assert w.worker.totals["blocks_load_failed.nvme"] == 1
    finally:
        U.shutdown(llm)


def test_as_a_child_of_multiconnector_with_another_hma_connector(gemma, gemma_prompts, gemma_baseline):
    """MultiConnector keeps HMA on only when every child is SupportsHMA: beside a recorder that
    never matches (tests/hma_child.py), kvtier serves the second pass."""
    from vllm.config import KVTransferConfig
    children = [{"kv_connector": "HMARecorder", "kv_connector_module_path": "hma_child", "kv_role": "kv_both"},
                {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.connector",
                 "kv_role": "kv_both", "kv_connector_extra_config": {"cpu_capacity_blocks": 256}}]
    cfg = KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both", kv_load_failure_policy="recompute",
                           kv_connector_extra_config={"connectors": children})
    llm = U.make_llm(gemma, cfg)
    try:
        s, _ = _sched()
        assert _hma_on(llm)
        assert U.generate(llm, gemma_prompts, MAX_TOKENS) == gemma_baseline
        assert U.generate(llm, gemma_prompts, MAX_TOKENS) == gemma_baseline
        assert s.sched.totals["hit_tokens"] == 4 * 6 * U.BLOCK
        import hma_child
        assert hma_child.FINISHED_ALL_GROUPS and all(len(ids) == 2 for ids in hma_child.FINISHED_ALL_GROUPS)
    finally:
        U.shutdown(llm)


def test_mamba_hybrid_serves_the_state_topology_bound(tmp_path):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    from kvtier.connector.groups import GroupKind
    U.set_env()
    torch.manual_seed(0)
    cfg = Qwen3NextConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=64, vocab_size=512, linear_num_value_heads=2,
                          linear_num_key_heads=2, linear_key_head_dim=64, linear_value_head_dim=64,
                          linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                          shared_expert_intermediate_size=64, full_attention_interval=2,
                          max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = str(tmp_path / "q")
    Qwen3NextForCausalLM(cfg).to(torch.bfloat16).save_pretrained(model, safe_serialization=True)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(300)] for _ in range(3)]
    kw = dict(dtype="bfloat16", block_size=None, enable_prefix_caching=True)  # align mode needs prefix caching
    llm = U.make_llm(model, **kw)
    base = U.generate(llm, prompts, MAX_TOKENS)
    U.shutdown(llm)
    llm = U.make_llm(model, U.kvtier_config(cpu_capacity_blocks=64), **kw)
    try:
        s, w = _sched()
        assert _hma_on(llm) and [g.kind for g in s.groups] == [GroupKind.MAMBA, GroupKind.FULL]
        # a Mamba state is not certified: blocks stay bound to the topology, and the start line says why
        assert s.parts.describe() == "topology-bound blocks (a layer that is not attention KV (a state, or an " \
            "unknown spec))" and s.fingerprint["tp"] == 1
        assert U.generate(llm, prompts, MAX_TOKENS) == base
        assert s.sched.totals["stored_blocks.cpu"] == 3 * (2 + 1)    # 2 attention blocks + the state at 256
        llm.reset_prefix_cache()                                     # vLLM forgets; kvtier serves
        assert U.generate(llm, prompts, MAX_TOKENS) == base
        t = s.sched.totals
        assert t["hit_tokens"] == 3 * 256 and t["hit_blocks.cpu"] == 3 * 3
        for p in w.worker.pools:                                     # not vacuous
            p.buffer.copy_(torch.full_like(p.buffer, 0x55))
        llm.reset_prefix_cache()
        assert U.generate(llm, prompts, MAX_TOKENS) != base
    finally:
        U.shutdown(llm)


def test_mla_model_one_group(tmp_path):
    """DeepSeek-V2 (MLA): one group. The CPU backend forces vLLM's prefix caching off, so the
    second pass is kvtier's; SupportsHMA routes its end through request_finished_all_groups.
    float32: in bfloat16 a prefill over loaded context rounds differently from a whole prefill
    (without kvtier too), which flips near-tied tokens of a random model."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM
    U.set_env()
    torch.manual_seed(0)
    cfg = DeepseekV2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=4, vocab_size=512, kv_lora_rank=512, q_lora_rank=None,
                           qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64, first_k_dense_replace=2,
                           n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, n_shared_experts=1,
                           max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = str(tmp_path / "d")
    DeepseekV2ForCausalLM(cfg).save_pretrained(model, safe_serialization=True)
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 512) for _ in range(100)] for _ in range(3)]
    kw = dict(dtype="float32", block_size=None)
    llm = U.make_llm(model, **kw)
    base = U.generate(llm, prompts, MAX_TOKENS)
    U.shutdown(llm)
    llm = U.make_llm(model, U.kvtier_config(cpu_capacity_blocks=128), **kw)
    try:
        s, w = _sched()
        assert not s.hybrid and len(s.groups) == 1
        assert U.generate(llm, prompts, MAX_TOKENS) == base
        assert U.generate(llm, prompts, MAX_TOKENS) == base
        assert s.sched.totals["hit_tokens"] == 3 * (99 // 16) * 16
        assert s.sched.leases.pinned() == 0
        for p in w.worker.pools:                                     # not vacuous
            p.buffer.copy_(torch.full_like(p.buffer, 0x55))
        assert U.generate(llm, prompts, MAX_TOKENS) != base
    finally:
        U.shutdown(llm)
