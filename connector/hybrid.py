"""The scheduler's rules for hybrid models (several KV-cache groups, `connector/groups.py`).

`KVTierScheduler` uses this when vLLM's hybrid allocator is on with more than one group (or one
group that is not full attention): keys per group, the one hit length every group can serve,
the blocks each group loads (into the block ids vLLM allocated for them), and the blocks each group
stores in the step that computes them (a sliding window's are nulled at the next step; a Mamba
state only at the block boundaries vLLM hands over). One-group models never come here.
"""

from __future__ import annotations

from typing import Any, Sequence

from kvtier.core.keys import GROUP_ID_BYTES

from .groups import Group, GroupKind, hit_tokens, key_index


class HybridRules:
    def __init__(self, groups: Sequence[Group], hash_tokens: int, reprefill: int = 0) -> None:
        self.groups = list(groups)
        self.hash_tokens = hash_tokens
        self.reprefill = reprefill   # trailing computed tokens not final yet (multi-module MTP)
        self._sfx = {g.gid: g.gid.to_bytes(GROUP_ID_BYTES, "big", signed=False) for g in self.groups}

    def key(self, hashes: Sequence[Any], g: Group, i: int) -> bytes | None:
        """Group `g`'s block `i`: the chained hash at its end plus the group id (None: not hashed yet)."""
        j = key_index(g, i, self.hash_tokens)
        return bytes(hashes[j]) + self._sfx[g.gid] if 0 <= j < len(hashes) else None

    def lookup(self, hashes: Sequence[Any], local: int, num_tokens: int,
               find: Any) -> tuple[int, list[tuple[int, int]], list[bytes]]:
        """(tokens beyond `local` every group can serve, the (group, block index) each loads, their
        keys); `find(key)` tells whether a tier holds a key."""
        seen: dict[tuple[int, int], bool] = {}

        def present(g: Group, i: int) -> bool:
            k = (g.gid, i)
            if k not in seen:
                key = self.key(hashes, g, i)
                seen[k] = key is not None and find(key)
            return seen[k]

        n = hit_tokens(self.groups, present, local, num_tokens, len(hashes), self.hash_tokens)
        plan: list[tuple[int, int]] = []
        keys: list[bytes] = []
        if n:
            for g in self.groups:
                for i in g.needed(local + n, local):
                    plan.append((g.gid, i))
                    keys.append(self.key(hashes, g, i))
        return n, plan, keys

    @staticmethod
    def destinations(plan: Sequence[tuple[int, int]], tables: Sequence[Sequence[int]]) -> list[int] | None:
        """vLLM's block ids for the planned (group, index) pairs; None when one is missing or the
        null block (the allocation differs from the plan: the load must not run)."""
        out = []
        for gid, i in plan:
            t = tables[gid] if gid < len(tables) else ()
            if i >= len(t) or not t[i]:
                return None
            out.append(t[i])
        return out

    def stores(self, hashes: Sequence[Any], computed: int, tables: Sequence[Sequence[int]], done: list[int],
               boundaries: Sequence[tuple[int, int, int]] = ()) -> list[tuple[bytes, int]]:
        """(key, block id) of the blocks to store now: per attention group the blocks that are full
        once `computed` tokens are (beyond `done[gid]`, the blocks already offered; null entries are
        blocks vLLM no longer keeps), and the Mamba states vLLM hands over (gid, block id, tokens)."""
        out: list[tuple[bytes, int]] = []
        for g in self.groups:
            if g.kind is GroupKind.MAMBA:
                continue
            t = tables[g.gid] if g.gid < len(tables) else ()
            # every full block, as vLLM caches them (a draft group's trailing block is dropped by
            # the hit that would load it: connector/groups.py)
            full = min(max(0, computed - self.reprefill) // g.block_tokens, len(t))
            for i in range(done[g.gid], full):
                key = self.key(hashes, g, i)
                if key is None:
                    full = i
                    break
                if t[i]:
                    out.append((key, t[i]))
            done[g.gid] = max(done[g.gid], full)
        by = {g.gid: g for g in self.groups}
        for gid, block_id, tokens in boundaries:
            g = by.get(gid)
            if g is None or g.kind is not GroupKind.MAMBA or tokens % g.block_tokens or not block_id:
                continue
            key = self.key(hashes, g, tokens // g.block_tokens - 1)
            if key is not None:
                out.append((key, block_id))
        return out
