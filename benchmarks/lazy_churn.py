"""Lazy offload's GPU -> CPU copies when the CPU tier is far smaller than vLLM's GPU pool.

Drives the connector's scheduler side (`KVTierScheduler`, offload "lazy") over vLLM's real
`BlockPool` the way vLLM's KV-cache manager does: each request's cached prefix is touched, the
rest allocated (vLLM evicts its LRU cached blocks) and cached, a few steps run (each step plans the
lazy walk and its copies complete), and at finish the blocks go back to the free queue, last
block first. Requests share prefixes (Zipf over `--prefixes`) and add blocks of their own.

Prints the GPU -> CPU block copies, the distinct blocks stored, copies per stored block, and the
GPU residencies (blocks vLLM computed into a GPU block: a shared prefix vLLM evicted and computes
again is a new one) with copies per residency, at most 1 when no copy is made twice.

    .venv/bin/python benchmarks/lazy_churn.py            # 266 rounds, 32-block CPU tier
"""

from __future__ import annotations

import argparse
import json
import random

from vllm.v1.core import kv_cache_utils as ku
from vllm.v1.core.block_pool import BlockPool

from kvtier.connector.metadata import KVTierWorkerMeta
from kvtier.connector.scheduler import KVTierScheduler, SchedulerOptions
from kvtier.core.controller import TierController
from kvtier.policies import PROMOTION
from kvtier.policies import EVICTION
from kvtier.tiers.base import SlotTier
from kvtier.tiers.gpu import BlockPoolContext

BT = 16   # tokens per block


class _Req:
    def __init__(self, rid: str, hashes: list, num_tokens: int) -> None:
        self.request_id = rid
        self.block_hashes = hashes
        self.num_tokens = num_tokens


def _hash(*parts: int) -> ku.BlockHash:
    return ku.BlockHash(b"".join(p.to_bytes(8, "big") for p in parts) + bytes(8))


def run(rounds: int = 266, gpu_blocks: int = 512, cpu_blocks: int = 32, budget: int = 64, per_round: int = 2,
        prefixes: int = 40, prefix_blocks: int = 8, own_blocks: int = 11, steps: int = 4, seed: int = 0) -> dict:
    rng = random.Random(seed)
    pool = BlockPool(num_gpu_blocks=gpu_blocks, enable_caching=True, hash_block_size=BT)
    tier = SlotTier("cpu", cpu_blocks, 64, EVICTION.get("lru")(cpu_blocks))
    s = KVTierScheduler(TierController([tier], block_tokens=BT, promotion=PROMOTION.get("inclusive")()),
                        options=SchedulerOptions(offload="lazy", max_blocks_per_step=budget))
    s.bind_gpu(BlockPoolContext(pool))
    weights = [1.0 / (i + 1) for i in range(prefixes)]
    stored: set[bytes] = set()
    requested = computed = n = 0

    def step(scheduled: list) -> None:
        meta = s.build_meta([(q, n, None if ids is None else [ids]) for q, n, ids in scheduled])
        for op in meta.stores:
            stored.update(k for k, _ in s.lazy.ops.get(op.op_id, ()))
        s.on_worker_meta(KVTierWorkerMeta(stored={op.op_id: [True] * len(op.slots) for op in meta.stores}))

    for _ in range(rounds):
        running = []
        for _ in range(per_round):
            p = rng.choices(range(prefixes), weights)[0]
            n += 1
            hashes = [_hash(1, p, i) for i in range(prefix_blocks)] + [_hash(2, n, i) for i in range(own_blocks)]
            req = _Req(f"r{n}", hashes, len(hashes) * BT + 1)
            hit = []
            for h in hashes:                       # vLLM's prefix cache: the longest cached prefix
                b = pool.get_cached_block(h, [0])
                if b is None:
                    break
                hit.append(b[0])
            pool.touch(hit)
            blocks = hit + pool.get_new_blocks(len(hashes) - len(hit))
            pool.cache_full_blocks(req, blocks, len(hit), len(hashes), BT, 0)
            ids = [b.block_id for b in blocks]
            s.lookup(req, 0)
            s.on_alloc(req, [ids], 0)
            requested += len(hashes)
            computed += len(hashes) - len(hit)     # a GPU residency each: vLLM computes the block there
            running.append((req, blocks))
        for _ in range(steps):
            step([(req.request_id, req.num_tokens, None) for req, _ in running])
        for req, blocks in running:
            s.on_finished(req.request_id, [[b.block_id for b in blocks]])
            pool.free_blocks(reversed(blocks))
    for _ in range(1000):                          # idle steps until the write-behind is done
        if not s.has_pending_push_work():
            break
        step([])
    copies = int(s.totals.get("lazy_offload_blocks", 0))
    return {"rounds": rounds, "requested_blocks": requested, "gpu_blocks": gpu_blocks, "cpu_blocks": cpu_blocks,
            "gpu_residencies": computed, "copies": copies, "stored_blocks": len(stored),
            "copies_per_stored_block": round(copies / max(1, len(stored)), 3),
            "copies_per_gpu_residency": round(copies / max(1, computed), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=266)
    ap.add_argument("--gpu-blocks", type=int, default=512)
    ap.add_argument("--cpu-blocks", type=int, default=32)
    ap.add_argument("--budget", type=int, default=64, help="max_blocks_per_step")
    ap.add_argument("--prefixes", type=int, default=40, help="shared prefixes (Zipf)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print(json.dumps(run(a.rounds, a.gpu_blocks, a.cpu_blocks, a.budget, prefixes=a.prefixes, seed=a.seed)))


if __name__ == "__main__":
    main()
