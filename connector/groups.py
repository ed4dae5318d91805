"""vLLM's KV-cache groups as kvtier serves them (hybrid models, `SupportsHMA`).

A hybrid model has several groups, each with its own block table over one block pool: full
attention (MLA too) needs every block of a prefix; a sliding window of W tokens only the blocks
the window covers before the hit's end; chunked local attention the current chunk's; Mamba /
linear attention one state, at the hit's end ("align" mode: a block boundary). A hit of N tokens
must be servable by every group at once. These are vLLM's own rules (its allocator gives a group
exactly the blocks `needed` lists as fresh, the rest as the null block); this module is pure
Python, so they are property-tested here.

Keys: a group's block i covers tokens [i * bt, (i + 1) * bt); its key is vLLM's chained block hash
at the block's last hash unit plus the 4-byte group id (`kvtier.core.keys`), so equal prefixes give
equal keys in every group, and a Mamba state at boundary N is keyed by the hash at N.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from kvtier.core.keys import GROUP_ID_BYTES


class GroupKind(enum.Enum):
    FULL = "full attention"          # every block of the prefix (MLA too)
    SLIDING = "sliding window"       # the window's blocks before the hit's end
    CHUNKED = "chunked local"        # the current chunk's blocks
    MAMBA = "state"                  # one state per request, at the hit's end


@dataclass(frozen=True)
class Group:
    gid: int
    kind: GroupKind
    block_tokens: int
    window: int = 0                  # SLIDING: W tokens
    extra: int = 0                   # SLIDING: extra_retained_tokens
    chunk: int = 0                   # CHUNKED: C tokens
    eagle: bool = False              # an EAGLE / MTP draft group: its trailing block is not served

    def skipped(self, n: int) -> int:
        """Tokens at the start of a hit of `n` whose blocks the group does not need."""
        if self.kind is GroupKind.SLIDING:
            return max(0, n - self.window + 1 - self.extra)
        if self.kind is GroupKind.CHUNKED:
            return n // self.chunk * self.chunk
        if self.kind is GroupKind.MAMBA:
            return max(0, n - 1)
        return 0

    def needed(self, n: int, local: int = 0) -> range:
        """Block indices a hit of `n` tokens loads in this group (those vLLM allocates fresh):
        what the group needs at `n`, less what vLLM's own cache computed (`local` tokens)."""
        bt = self.block_tokens
        lo = max(self.skipped(n) // bt, local // bt)
        return range(lo, -(-n // bt))


def key_index(g: Group, i: int, hash_tokens: int) -> int:
    """Index into the request's block hashes of group `g`'s block `i` (the hash at its end)."""
    return (i + 1) * g.block_tokens // hash_tokens - 1


def hit_tokens(groups: Sequence[Group], present: Callable[[Group, int], bool], local: int, num_tokens: int,
               num_hashes: int, hash_tokens: int) -> int:
    """Tokens beyond `local` (vLLM's own hit, a multiple of every group's block) that every group
    can serve: the largest N <= the cap with every group's `needed(N)` blocks present, where the
    cap leaves one token to compute, stays within the hashed blocks and is a multiple of the
    groups' common block (each group's blocks end at N). Full-attention groups are a prefix
    (the longest present run from `local`); the others are checked at each candidate, lowering N
    until every group agrees (vLLM's own fixed point).

    With an EAGLE / MTP draft group the draft's last block of a hit is not trusted (vLLM drops it
    from its own hits): the hit is found one block past the cap, that block dropped, and the
    fixed point run again below it (a window's needs are not downward-closed)."""
    unit = 1
    for g in groups:
        unit = math.lcm(unit, g.block_tokens)
    cap = min(num_tokens - 1, num_hashes * hash_tokens) // unit * unit
    if any(g.eagle for g in groups):
        over = min(num_tokens - 1 + unit, num_hashes * hash_tokens) // unit * unit
        n = _fixed_point(groups, present, local, over, unit) - unit
        if n <= local:
            return 0
        cap = min(cap, n)
    return max(0, _fixed_point(groups, present, local, cap, unit) - local)


def _fixed_point(groups: Sequence[Group], present: Callable[[Group, int], bool], local: int, cap: int,
                 unit: int) -> int:
    """The largest N in (local, cap], a multiple of `unit`, every group can serve; else `local`."""
    n = cap
    while n > local:
        lowered = False
        for g in sorted(groups, key=lambda g: g.kind is not GroupKind.FULL):  # prefixes first
            if g.kind is GroupKind.FULL:
                i = local // g.block_tokens
                end = n // g.block_tokens
                while i < end and present(g, i):
                    i += 1
                m = i * g.block_tokens // unit * unit
            else:
                m = n
                while m > local and not all(present(g, i) for i in g.needed(m, local)):
                    m -= unit
            if m < n:
                n, lowered = m, True
                break
        if not lowered:
            break
    return max(local, n)


def block_span(spec: Any, dcp: int = 1) -> int:
    """Tokens one block of a group spans: its spec's (per-rank) block size, times `dcp` where
    decode context parallelism shards its tokens (vLLM's `resolve_dcp_kv_block_size`)."""
    sharded = dcp > 1 and bool(getattr(spec, "dcp_sharded", True))
    return int(spec.block_size) * (dcp if sharded else 1)


def groups_of(kv_cache_config: Any, dcp: int = 1) -> list[Group]:
    """The groups of vLLM's `KVCacheConfig` kvtier serves (its prefix-cacheable ones), in order,
    each block spanning `block_span` tokens (`dcp`: decode context parallel size).
    A spec kvtier does not know (cross attention, encoder-only...) is not served: ValueError."""
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec, MambaSpec, SlidingWindowSpec

    serve = set(getattr(kv_cache_config, "prefix_cacheable_group_ids", range(len(kv_cache_config.kv_cache_groups))))
    out = []
    for gid, g in enumerate(kv_cache_config.kv_cache_groups):
        if gid not in serve:
            continue
        spec, eagle = g.kv_cache_spec, bool(getattr(g, "is_eagle_group", False))
        bt = block_span(spec, dcp)
        if isinstance(spec, MambaSpec):
            out.append(Group(gid, GroupKind.MAMBA, bt, eagle=eagle))
        elif isinstance(spec, SlidingWindowSpec):
            out.append(Group(gid, GroupKind.SLIDING, bt, window=int(spec.sliding_window),
                             extra=int(spec.extra_retained_tokens), eagle=eagle))
        elif isinstance(spec, ChunkedLocalAttentionSpec):
            out.append(Group(gid, GroupKind.CHUNKED, bt, chunk=int(spec.attention_chunk_size), eagle=eagle))
        elif isinstance(spec, FullAttentionSpec):
            out.append(Group(gid, GroupKind.FULL, bt, eagle=eagle))
        else:
            raise ValueError(f"KV-cache group {gid}: {type(spec).__name__} is not a kind kvtier serves")
    return out


def block_geometry(kv_cache_config: Any, dcp: int = 1) -> tuple[int, int]:
    """(bytes of one block id over every layer region, vLLM's scheduler block in tokens). With
    several groups (the hybrid allocator) the groups' layers are overlaid on the same regions (one
    page per layer and block, the same size in every group), so a block id owns one page of each
    region whatever its group: the largest group's pages. Under decode context parallelism
    (`dcp`) the bytes are this rank's pages, the tokens the block's whole span (`block_span`)."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", []) or [])
    if not groups:
        return 0, 0
    bb = max(int(g.kv_cache_spec.page_size_bytes) * len(g.layer_names) for g in groups)
    bt = 1
    for g in groups:
        bt = math.lcm(bt, block_span(g.kv_cache_spec, dcp))
    return bb, bt


def served_groups(kv_cache_config: Any, eagle: bool = False, cp: tuple[int, int] = (1, 1)) -> tuple[list, str | None]:
    """(the groups kvtier serves, why it cannot serve them or None). `eagle`: speculative decoding
    drops the draft's trailing block (vLLM's `use_eagle_block_drop`); where vLLM flags no group as
    the draft's (a one-group model), every group counts as the draft's, as in vLLM's own cache.
    `cp`: (dcp, pcp); under context parallelism only full-attention groups are served (the
    others' per-rank state under it is not a shard kvtier knows how to serve)."""
    if kv_cache_config is None or not getattr(kv_cache_config, "kv_cache_groups", None):
        return [], "no KV-cache groups"
    try:
        groups = groups_of(kv_cache_config, cp[0])
    except ValueError as e:
        return [], str(e)
    if not groups:
        return [], "no prefix-cacheable KV-cache group"
    other = sorted({g.kind.value for g in groups if g.kind is not GroupKind.FULL})
    if max(cp) > 1 and other:
        return [], (f"context parallelism (dcp {cp[0]}, pcp {cp[1]}) with {', '.join(other)} KV-cache groups: "
                    f"kvtier serves only full attention under it")
    if any(g.block_tokens % min(x.block_tokens for x in groups) for g in groups):
        return [], "KV-cache groups whose block sizes do not divide each other"
    if eagle and not any(g.eagle for g in groups):   # vLLM: KVCacheCoordinator's fallback
        groups = [dataclasses.replace(g, eagle=True) for g in groups]
    return groups, None


# ---- the scheduler's rules for the groups ------------------------------------------------------------
class GroupRules:
    """The scheduler runs every model through these: keys per group, the one hit length every group
    can serve, the blocks each group loads (into the block ids vLLM allocated for them), and the
    blocks each group stores in the step that computes them (a sliding window's are nulled at the
    next step; a Mamba state only at the block boundaries vLLM hands over). A one-group model is
    the case of one full-attention group: its hit is a prefix of one chain (`chain`), which the
    shared tier can serve and whose load errors vLLM takes per block."""

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
