"""Offline Belady MIN under the chained-prefix rule: the one yardstick (replay, compare, plot, plan).

Replay: a request hits the longest prefix of its ``hash_ids`` that is cached; then its blocks
are inserted. When the cache is full, the resident block whose next use is farthest in the
future leaves first (blocks never used again first); a new block whose own next use is farther
than every resident block's is not kept (MIN with bypass, which is what "insert, then evict the
farthest" amounts to). Ties on the next use go deepest-first: the block deeper in its request
leaves first, because under the prefix rule a descendant is useless without its ancestor (ties
broken by block id can keep a child and drop its parent, which loses the child's hit too).

`vllm=True` applies the rules `kvtier replay` and the vLLM connector serve under: only full
blocks are inserted, and at least one token is left to compute (a request hits at most
``(input_length - 1) // block_tokens`` blocks). The default is the plain prefix rule of
`kvtier.offline.sim.simulate` (every block can hit and is inserted).

Needs the future, so it is never a runtime policy. O(refs log capacity): next uses are
precomputed in one backward pass; a max-heap with lazy invalidation finds the victim.
"""

from __future__ import annotations

import heapq
from typing import Sequence

from kvtier.offline.trace import BLOCK_TOKENS, Request

_NEVER = 1 << 40


def next_uses(reqs: Sequence[Request]) -> list[list[int]]:
    """For each request and block position, the index of the next request using that block."""
    nxt: dict[int, int] = {}
    out: list[list[int]] = [None] * len(reqs)  # type: ignore[list-item]
    for i in range(len(reqs) - 1, -1, -1):
        h = reqs[i].hash_ids
        row = [nxt.get(b, _NEVER) for b in h]
        for b in h:
            nxt[b] = i
        out[i] = row
    return out


def belady(reqs: Sequence[Request], capacity_blocks: int, block_tokens: int = BLOCK_TOKENS,
           vllm: bool = False, nu: list[list[int]] | None = None) -> dict:
    """Block and token hit ratio of offline MIN (ties deepest-first) with `capacity_blocks` under
    the prefix rule (`vllm=True`: full blocks only, at least one token left to compute). `nu`:
    `next_uses(reqs)`, when several capacities share it."""
    if capacity_blocks <= 0:
        raise ValueError("capacity_blocks must be > 0")
    nu = nu if nu is not None else next_uses(reqs)
    cur: dict[int, int] = {}   # resident block -> its current priority (next_use << 16 | depth)
    heap: list[tuple[int, int]] = []  # (-priority, block), lazily invalidated
    push, pop = heapq.heappush, heapq.heappop
    hits = refs = 0
    hit_tok = in_tok = 0
    cap = capacity_blocks
    bt = block_tokens
    for i, r in enumerate(reqs):
        h = r.hash_ids
        n = len(h)
        if vllm and not n:
            continue  # as replay: a request without blocks is not counted
        refs += n
        in_tok += r.input_length
        if vllm:
            full = min(n, r.input_length // bt)
            most = min(full, (r.input_length - 1) // bt)
        else:
            full = most = n
        k = 0
        while k < most and h[k] in cur:
            k += 1
        hits += k
        if k:
            hit_tok += min(k * bt, r.input_length) if k == n else k * bt
        row = nu[i]
        for j in range(full):
            b = h[j]
            pri = (row[j] << 16) | min(j, 0xFFFF)
            if b in cur:
                cur[b] = pri
                push(heap, (-pri, b))
                continue
            if row[j] == _NEVER:
                continue  # never used again: bypass
            if len(cur) >= cap:
                # evict the farthest resident, unless the newcomer is farther still
                while True:
                    npri, v = heap[0]
                    if cur.get(v) != -npri:
                        pop(heap)
                        continue
                    break
                if -npri <= pri:
                    continue  # bypass the newcomer
                pop(heap)
                del cur[v]
            cur[b] = pri
            push(heap, (-pri, b))
        if len(heap) > 4 * cap + 1024:  # compact stale entries
            heap = [(-p, b) for b, p in cur.items()]
            heapq.heapify(heap)
    return {"hit_ratio": hits / refs if refs else 0.0, "token_hit_ratio": hit_tok / in_tok if in_tok else 0.0,
            "hit_blocks": hits, "total_blocks": refs, "capacity_blocks": capacity_blocks}
