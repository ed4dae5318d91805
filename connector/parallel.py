"""Which worker writes which shard of a block under vLLM's parallelism.

Tensor (and pipeline) parallel ranks each hold a different part of every block: each rank stores
its own shard (its NVMe file `data.<rank>`, its own checksum, its own shared-tier keys), and a
block is whole once every rank reported it. MLA under tensor parallelism alone is the exception:
every rank holds the same latent KV, so rank 0 alone writes the NVMe file and the shared tier
(once, as vLLM's own offloading does) and every rank reads what it wrote. Each rank still copies
the blocks it computed into its own DRAM pool (a pool shared across the ranks' processes is not
built yet).
"""

from __future__ import annotations

from typing import Any


def world_size(vllm_config: Any) -> int:
    """Workers holding a shard of every block (tensor x pipeline parallel)."""
    return int(getattr(getattr(vllm_config, "parallel_config", None), "world_size", 1) or 1)


def replicated(vllm_config: Any, kv_cache_config: Any = None) -> bool:
    """Every worker holds the same bytes of every block: an MLA model under tensor parallelism
    and nothing else (no pipeline stages, no context parallelism splitting tokens), with every
    layer's KV the same on all TP ranks where vLLM says so (`kv_tp_replicas`, vLLM 0.32+)."""
    mc, pc = getattr(vllm_config, "model_config", None), getattr(vllm_config, "parallel_config", None)
    if mc is None or pc is None or not getattr(mc, "use_mla", False):
        return False
    tp = int(getattr(pc, "tensor_parallel_size", 1) or 1)
    replicas = getattr(kv_cache_config, "kv_tp_replicas", None)
    return (tp > 1 and world_size(vllm_config) == tp and replicas in (None, tp)
            and int(getattr(pc, "pipeline_parallel_size", 1) or 1) == 1
            and int(getattr(pc, "decode_context_parallel_size", 1) or 1) == 1
            and int(getattr(pc, "prefill_context_parallel_size", 1) or 1) == 1)


def shards(vllm_config: Any, kv_cache_config: Any = None) -> int:
    """Shards of each block written (the ranks the scheduler waits for): 1 when replicated."""
    return 1 if replicated(vllm_config, kv_cache_config) else world_size(vllm_config)


def store_rank(vllm_config: Any, rank: int, kv_cache_config: Any = None) -> int:
    """Whose shard the worker of `rank` writes and reads: rank 0's when replicated."""
    return 0 if replicated(vllm_config, kv_cache_config) else rank
