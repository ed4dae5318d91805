"""Helpers for tests that run real vLLM on the CPU: a tiny random Llama, LLM construction."""

from __future__ import annotations

import os
import random
from pathlib import Path

BLOCK = 32


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
        return True
    except Exception:
        return False


def set_env() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


PARTS = 2   # the tiny Llama's 2 KV heads: a parallel-agnostic block is stored as 2 parts (files, values)


def build_tiny_llama(path: str | Path, seed: int = 0) -> str:
    """Save a random 2-layer Llama (head_dim 32, 2 KV heads, vocab 512) under `path`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return str(path)
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=2048,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # larger weights so greedy tokens depend on the context strongly
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else None
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


def build_tiny_gemma3(path: str | Path, seed: int = 0, window: int = 64) -> str:
    """Save a random 4-layer Gemma-3 (sliding window `window` on every other layer: two KV-cache
    groups, full and sliding) under `path`."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    path = Path(path)
    if (path / "config.json").exists():
        return str(path)
    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=32, vocab_size=512, sliding_window=window,
                           layer_types=["sliding_attention", "full_attention"] * 2, max_position_embeddings=2048,
                           bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = Gemma3ForCausalLM(cfg)
    with torch.no_grad():  # larger weights so greedy tokens depend on the context strongly
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else None
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


def prompts(n: int, blocks: int, seed: int = 1, extra: int = 5) -> list[list[int]]:
    """n token-id prompts of `blocks` full blocks plus `extra` tokens (ids 3..511)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(blocks * BLOCK + extra)] for _ in range(n)]


def make_llm(model_dir: str, kv_transfer_config=None, enable_prefix_caching: bool = False, **kw):
    set_env()
    from vllm import LLM

    # KVTIER_E2E_CUDA_GRAPHS=1 on a GPU with vLLM: CUDA graphs (kvtier makes them piecewise)
    eager = os.environ.get("KVTIER_E2E_CUDA_GRAPHS") != "1"
    args = dict(model=model_dir, skip_tokenizer_init=True, dtype="float32", enforce_eager=eager,
                block_size=BLOCK, distributed_executor_backend="uni", max_model_len=1024,
                max_num_seqs=8, enable_prefix_caching=enable_prefix_caching, seed=0,
                gpu_memory_utilization=0.5)
    args.update(kw)
    if kv_transfer_config is not None:
        args["kv_transfer_config"] = kv_transfer_config
    return LLM(**args)


def generate(llm, token_prompts: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in token_prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def run_steps(llm, steps: int) -> None:
    """Drive `steps` engine steps that store nothing (a prompt shorter than one block), so that
    NVMe writes running behind (write-behind, `nvme_write_lag_steps`) are reported."""
    generate(llm, [[5, 6, 7]], max_tokens=min(steps, BLOCK - 4))


def kvtier_config(failure_policy: str = "recompute", **extra):
    """KVTransferConfig mounting kvtier; `extra` goes to kv_connector_extra_config."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_connector="KVTierConnector", kv_connector_module_path="kvtier.connector",
                            kv_role="kv_both", kv_connector_extra_config=dict(extra),
                            kv_load_failure_policy=failure_policy)


def multi_config(example_path: str, failure_policy: str = "recompute", kvtier_first: bool = False, **extra):
    """MultiConnector with vLLM's ExampleConnector and kvtier (Example first unless kvtier_first)."""
    from vllm.config import KVTransferConfig

    children = [
        {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
         "kv_connector_extra_config": {"shared_storage_path": example_path}},
        {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.connector",
         "kv_role": "kv_both", "kv_connector_extra_config": dict(extra)},
    ]
    if kvtier_first:
        children.reverse()
    return KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both",
                            kv_load_failure_policy=failure_policy,
                            kv_connector_extra_config={"connectors": children})


def shutdown(llm) -> None:
    import gc

    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    try:  # vLLM's shutdown calls the connectors' shutdown; make sure (NVMe directory lock)
        import kvtier.connector as C
        for c in C.live_connectors():
            c.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()


TIER_KEYS = ("hit_tokens.cpu", "hit_tokens.nvme")


def tier_hits(before: dict, after: dict) -> dict:
    """External hit tokens per tier between two snapshots of the scheduler's totals."""
    return {k.split(".", 1)[1]: int(after.get(k, 0) - before.get(k, 0)) for k in TIER_KEYS}
