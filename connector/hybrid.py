"""The scheduler's rules for vLLM's KV-cache groups (`connector/groups.py`).

`KVTierScheduler` runs every model through these: keys per group, the one hit length every
group can serve, the blocks each group loads (into the block ids vLLM allocated for them), and
the blocks each group stores in the step that computes them (a sliding window's are nulled at
the next step; a Mamba state only at the block boundaries vLLM hands over). A one-group model
is the case of one full-attention group: its hit is a prefix of one chain (`chain`), which the
shared tier can serve and whose load errors vLLM takes per block.
"""

from __future__ import annotations

from typing import Any, Sequence

from kvtier.core.keys import GROUP_ID_BYTES

from .groups import Group, GroupKind, hit_tokens, key_index


class GroupRules:
    def __init__(self, groups: Sequence[Group], hash_tokens: int, reprefill: int = 0) -> None:
        self.groups = list(groups)
        self.hash_tokens = hash_tokens
        self.reprefill = reprefill   # trailing computed tokens not final yet (multi-module MTP)
        self._sfx = {g.gid: g.gid.to_bytes(GROUP_ID_BYTES, "big", signed=False) for g in self.groups}
        g0 = self.groups[0]
        # one full-attention group and no draft's block to drop: a hit is a prefix of one chain
        self.chain = len(self.groups) == 1 and g0.kind is GroupKind.FULL and not g0.eagle

    def hash_every(self, tokens: int) -> None:
        """vLLM's block hashes cover `tokens` tokens each (its pool's `hash_block_size`)."""
        self.hash_tokens = int(tokens)

    @classmethod
    def one_group(cls, block_tokens: int) -> "GroupRules":
        """A model with one full-attention group of `block_tokens`-token blocks."""
        return cls([Group(0, GroupKind.FULL, block_tokens)], block_tokens)

    def key(self, hashes: Sequence[Any], g: Group, i: int) -> bytes | None:
        """Group `g`'s block `i`: the chained hash at its end plus the group id (None: not hashed yet)."""
        j = key_index(g, i, self.hash_tokens)
        return bytes(hashes[j]) + self._sfx[g.gid] if 0 <= j < len(hashes) else None

    def chain_keys(self, hashes: Sequence[Any], start: int, end: int) -> list[bytes]:
        """The first group's keys of blocks [start, end) (those hashed)."""
        g = self.groups[0]
        out = []
        for i in range(start, end):
            k = self.key(hashes, g, i)
            if k is None:
                break
            out.append(k)
        return out

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

    def accepted(self, plan: Sequence[tuple[int, int]], start: int, tokens: int) -> list[tuple[int, int]]:
        """The planned blocks vLLM accepted `tokens` of (from block `start`): a chain's leading
        blocks; with several groups the whole hit or nothing (each group needs its own blocks at
        the hit's end), so a shorter acceptance leaves the plan to the allocation check."""
        if self.chain:
            return [p for p in plan if p[1] < start + tokens // self.groups[0].block_tokens]
        return list(plan)

    def destinations(self, plan: Sequence[tuple[int, int]], tables: Sequence[Sequence[int]]) -> list[int] | None:
        """vLLM's block ids for the planned (group, index) pairs; None when one is missing or the
        null block (the allocation differs from the plan: the load must not run)."""
        by = {g.gid: g for g in self.groups}
        out = []
        for gid, i in plan:
            t = tables[gid] if gid < len(tables) else ()
            if i >= len(t) or self._null(by[gid], t[i]):
                return None
            out.append(t[i])
        return out

    @staticmethod
    def _null(g: Group, block_id: int) -> bool:
        """vLLM's null block (id 0) stands for a block a window or state group no longer keeps;
        a full-attention group has none."""
        return not block_id and g.kind is not GroupKind.FULL

    def stores(self, hashes: Sequence[Any], computed: int, tables: Sequence[Sequence[int]], done: list[int],
               boundaries: Sequence[tuple[int, int, int]] = ()) -> tuple[list[tuple[bytes, int]], int]:
        """((key, block id) of the blocks to store now, the chain position of the first or 0 with
        several groups): per attention group the blocks that are full once `computed` tokens are
        (beyond `done[gid]`, the blocks already offered; null entries are blocks vLLM no longer
        keeps), and the Mamba states vLLM hands over (gid, block id, tokens)."""
        out: list[tuple[bytes, int]] = []
        first = done[self.groups[0].gid] if self.chain else 0
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
                if not self._null(g, t[i]):
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
        return out, first

    def offer_again(self, done: list[int], tokens: int) -> None:
        """A failed load: vLLM recomputes from `tokens`; each group's blocks from there are offered again."""
        for g in self.groups:
            done[g.gid] = min(done[g.gid], tokens // g.block_tokens)

    def mark_loaded(self, done: list[int], tokens: int) -> None:
        """What a load brought (up to `tokens`) is not stored again."""
        for g in self.groups:
            done[g.gid] = max(done[g.gid], tokens // g.block_tokens)

    def new_done(self) -> list[int]:
        return [0] * (1 + max(g.gid for g in self.groups))
