"""Single-tier metadata replay of a request trace: the controller on one tier, no bytes.

The same TierController and policies that run inside vLLM (`kvtier.offline.replay.replay` on a one-tier
stack with no data), so a policy measured here is the policy served; it exists for sweeps
(capacities x policies) and the yardstick comparisons next to Belady.

Block hit ratio = hit blocks / block references; token hit ratio = hit tokens / input tokens,
where a hit block counts block_tokens tokens except a partial last block, which counts its
real tokens.
"""

from __future__ import annotations

from typing import Any, Sequence

from kvtier.offline.trace import BLOCK_TOKENS, Request


def simulate(requests: Sequence[Request], capacity_blocks: int, eviction: str = "lru",
             admission: str = "all", eviction_params: dict[str, Any] | None = None,
             admission_params: dict[str, Any] | None = None, block_tokens: int = BLOCK_TOKENS,
             keys: list[list[bytes]] | None = None, warmup: int = 0, vllm: bool = False) -> dict:
    """Replay `requests` through one metadata-only tier of `capacity_blocks` slots: the
    controller and the policies vLLM runs (`kvtier.offline.replay.replay` on a one-tier stack, no bytes).

    `keys` may be passed (from make_keys) to reuse them across runs. The first `warmup`
    requests fill the cache but are not counted. The default is the prefix rule Belady is
    measured under (every block of the trace can hit and is stored); `vllm=True` is what the
    served system does and `kvtier replay` measures (full blocks only, at least one token
    left to compute).
    """
    from kvtier.core.config import parse_config
    from kvtier.offline.replay import replay
    from kvtier.core.stack import TierStack

    if capacity_blocks <= 0:
        raise ValueError("capacity_blocks must be > 0")
    params = {}
    if eviction_params:
        params[eviction] = dict(eviction_params)
    if admission_params:
        params[admission] = dict(admission_params)
    cfg = parse_config({"block_bytes": 4096, "block_tokens": block_tokens,
                        "tiers": [{"name": "sim", "kind": "cpu", "capacity_blocks": capacity_blocks}],
                        "policy": {"eviction": eviction, "admission": admission, "params": params}},
                       source="<simulate>", check_env=False)
    with TierStack.from_config(cfg, with_data=False) as stack:
        r = replay(stack, requests, block_tokens, keys=keys, vllm=vllm, warmup=warmup)
        tot = stack.ctrl.totals
    return {
        "eviction": eviction, "admission": admission, "capacity_blocks": capacity_blocks,
        "hit_ratio": r["hit_ratio"], "token_hit_ratio": r["token_hit_ratio"],
        "hit_blocks": r["hit_blocks"], "total_blocks": r["block_refs"], "hit_tokens": r["hit_tokens"],
        "input_tokens": r["input_tokens"], "evictions": int(tot.get("evicted_blocks.sim", 0)),
        "admitted": int(tot.get("stored_blocks.sim", 0)), "rejected": int(tot.get("not_admitted_blocks.sim", 0)),
        "seconds": r["seconds"], "blocks_per_s": r["blocks_per_s"],
    }
