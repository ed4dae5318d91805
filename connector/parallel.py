"""Which worker writes which shard of a block under vLLM's parallelism.

Tensor (and pipeline) parallel ranks each hold a different part of every block: each rank stores
its own shard (its NVMe file `data.<rank>`, its own checksum, its own shared-tier keys), and a
block is whole once every rank reported it. MLA under tensor parallelism alone is the exception:
every rank holds the same latent KV, so rank 0 alone writes the NVMe file and the shared tier
(once, as vLLM's own offloading does) and every rank reads what it wrote. Each rank still copies
the blocks it computed into its own DRAM pool (a pool shared across the ranks' processes is not
built yet).

Context parallelism (`context_parallel`) shards tokens, not heads: under decode context parallel
(DCP) one of vLLM's blocks spans `block_size x dcp` tokens (its scheduler block and block hash),
and each DCP rank holds the tokens whose `interleave`-token chunk falls to it, at the same block
id; prefill context parallel (PCP) ranks each hold the block's KV gathered back from the others.
A rank's page of a block is still its own bytes of that block, so each rank writes its own shard
as under TP; dcp, pcp and the interleave are in the fingerprint, since they decide those bytes.
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


def context_parallel(vllm_config: Any) -> tuple[int, int, int]:
    """(dcp, pcp, interleave) as the workers run them; (1, 1, 1) without context parallelism.
    The interleave is the deprecated `dcp_kv_cache_interleave_size` when that is set: vLLM's
    workers take it over `cp_kv_cache_interleave_size` before their connector is built
    (`VllmConfig.adjust_dcp_kv_cache_interleave_size`), the scheduler's process never does."""
    pc = getattr(vllm_config, "parallel_config", None)
    dcp = int(getattr(pc, "decode_context_parallel_size", 1) or 1)
    pcp = int(getattr(pc, "prefill_context_parallel_size", 1) or 1)
    if dcp * pcp == 1:
        return 1, 1, 1
    interleave = int(getattr(pc, "cp_kv_cache_interleave_size", 1) or 1)
    old = int(getattr(pc, "dcp_kv_cache_interleave_size", 1) or 1)
    return dcp, pcp, old if dcp > 1 and old > 1 else interleave


def context_parallel_refused(vllm_config: Any) -> str | None:
    """Why kvtier does not serve this context parallelism, or None. NIXL P/D under DCP: vLLM's
    workers may re-set the interleave to their block size after the scheduler started, so the
    scheduler's fingerprint could not name the bytes the workers write."""
    dcp, _, _ = context_parallel(vllm_config)
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    if dcp > 1 and ktc is not None and ktc.has_connector("NixlConnector"):
        return (f"decode context parallel (dcp {dcp}) with NixlConnector: vLLM's workers may re-set "
                f"cp_kv_cache_interleave_size after the scheduler started")
    return None
