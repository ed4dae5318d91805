"""Fast single-tier metadata replay of a request trace through a real SlotTier.

No bytes move: each request looks up its chained keys (the prefix rule), records the hit,
pins the hit prefix for the duration of the request (as a lease would), asks the admission
policy which missing blocks to keep, evicts victims from the tier's cursor when the tier is
full, then allocates and commits the admitted blocks. The eviction policy sees exactly the
calls it sees inside the full stack (on_insert / on_hit / on_remove / victims).

Block hit ratio = hit blocks / block references; token hit ratio = hit tokens / input tokens,
where a hit block counts block_tokens tokens except a partial last block, which counts its
real tokens.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from kvtier.keys import make_key
from kvtier.policies import ADMISSION, EVICTION, RequestInfo
from kvtier.tiers.base import SlotTier

from .trace import BLOCK_TOKENS, Request


def make_keys(reqs: Sequence[Request]) -> list[list[bytes]]:
    """Per request, its chain of block keys (one bytes object per unique block, shared)."""
    cache: dict[int, bytes] = {}
    out = []
    for r in reqs:
        row = []
        for h in r.hash_ids:
            k = cache.get(h)
            if k is None:
                k = cache[h] = make_key(h)
            row.append(k)
        out.append(row)
    return out


def simulate(requests: Sequence[Request], capacity_blocks: int, eviction: str = "lru",
             admission: str = "all", eviction_params: dict[str, Any] | None = None,
             admission_params: dict[str, Any] | None = None, block_tokens: int = BLOCK_TOKENS,
             keys: list[list[bytes]] | None = None, warmup: int = 0, vllm: bool = False) -> dict:
    """Replay `requests` through one SlotTier of `capacity_blocks` slots.

    `keys` may be passed (from make_keys) to reuse them across runs. The first `warmup`
    requests fill the cache but are not counted. The default is the prefix rule Belady is
    measured under (every block of the trace can hit and is stored); `vllm=True` is what the
    served system does and `kvtier replay` measures (full blocks only, at least one token
    left to compute).
    """
    if capacity_blocks <= 0:
        raise ValueError("capacity_blocks must be > 0")
    pol = EVICTION.get(eviction)(capacity_blocks, **(eviction_params or {}))
    adm = ADMISSION.get(admission)(**(admission_params or {}))
    tier = SlotTier("sim", capacity_blocks, 0, pol)
    if keys is None:
        keys = make_keys(requests)
    t0 = time.perf_counter()
    slot_of = tier.resident  # read-only fast path (same dict lookup() walks)
    lookup, touch, free, hit = tier.lookup, tier.touch, tier.free_blocks, tier.hit
    allocate, commit, evict = tier.allocate, tier.commit, tier.evict
    free_slots = tier.free_slots
    admit, on_evict = adm.admit, adm.on_evict
    admit_all = admission == "all"
    hits = refs = 0
    hit_tok = in_tok = 0
    evictions = admitted = rejected = 0
    for idx, r in enumerate(requests):
        ks = keys[idx]
        n = len(ks)
        if n == 0:
            continue
        if vllm:  # vLLM offers full blocks only and computes at least one token
            full = min(n, r.input_length // block_tokens)
            k = lookup(ks[:min(full, (r.input_length - 1) // block_tokens)])
        else:
            full = n
            k = lookup(ks)
        counted = idx >= warmup
        if counted:
            refs += n
            hits += k
            in_tok += r.input_length
            if k:
                if k == n and r.input_length < n * block_tokens:
                    hit_tok += r.input_length
                else:
                    hit_tok += k * block_tokens
        now = r.timestamp / 1000.0
        info = RequestInfo(ks, 0, k, r.input_length, block_tokens, now)
        # resident blocks of the request (the hit prefix and any resident beyond a gap)
        if k == full:
            if k:
                hit([slot_of[x] for x in ks[:k]], info)
            continue
        res = [slot_of[x] for x in ks[:k]]
        missing = []
        for j in range(k, full):
            s = slot_of.get(ks[j])
            if s is None:
                missing.append(j)
            else:
                res.append(s)
        if res:
            hit(res, info)
            touch(res)  # the request's lease: its own blocks are not victims
        if not admit_all:
            mask = admit([ks[j] for j in missing], info)
            keep = [j for j, m in zip(missing, mask) if m]
            rejected += len(missing) - len(keep)
            missing = keep
        if missing:
            room = capacity_blocks - len(res)
            if len(missing) > room:
                missing = missing[:room]
            need = len(missing) - tier.num_free_slots
            if need > 0:
                gone = evict(free_slots(need))
                evictions += len(gone)
                if not admit_all:
                    for g in gone:
                        on_evict(g)
            admitted += len(missing)
            # commit per contiguous run so info.start tells the policy each run's position
            i0 = 0
            m = len(missing)
            while i0 < m:
                i1 = i0 + 1
                while i1 < m and missing[i1] == missing[i1 - 1] + 1:
                    i1 += 1
                j0 = missing[i0]
                run = ks[j0:j0 + (i1 - i0)]
                slots = allocate(run)
                commit(slots, info if j0 == 0 else RequestInfo(ks, j0, k, r.input_length, block_tokens, now))
                i0 = i1
        if res:
            free(res)
    dt = time.perf_counter() - t0
    return {
        "eviction": eviction, "admission": admission, "capacity_blocks": capacity_blocks,
        "hit_ratio": hits / refs if refs else 0.0,
        "token_hit_ratio": hit_tok / in_tok if in_tok else 0.0,
        "hit_blocks": hits, "total_blocks": refs, "hit_tokens": hit_tok, "input_tokens": in_tok,
        "evictions": evictions, "admitted": admitted, "rejected": rejected,
        "seconds": dt, "blocks_per_s": (sum(len(x) for x in keys) / dt) if dt > 0 else float("inf"),
    }
