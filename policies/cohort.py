"""Conversation-cohort eviction ("cohort"): pslru plus a stable sample of cold conversations.

When the cache is too small to hold every new conversation until its next turn, LRU keeps
each for a window shorter than the typical inter-turn gap and so keeps none long enough. This
policy splits the cold (unproven) blocks into two lists by a hash of the conversation's root:
a deterministic share `sample` of conversations ("sampled") outlives the rest, so that share
lives about 1/sample times longer. The root is the request's first block not found in the
stack (info.keys[hit_blocks]); a request that continues a cached prefix of at least
`warm_hit` blocks is always treated as sampled (the choice is stable across turns).

Lists, in victim order (each head to tail): doomed partial last blocks, unsampled cold,
sampled cold, then the protected levels 1..levels-1 of pslru (a hit moves a block up one
level; the protected levels share `protected_ratio` of the capacity; an over-quota level
demotes its head one level down; a key found in the ghost history of the last
`ghost_ratio` x capacity evicted keys re-enters one level above the one it left, at least
level 1). A request's blocks are pushed deepest first (leaf-first).

Optional `short_output` (tokens; 0 = off, the default): when a request that generated fewer
tokens finishes (RequestInfo.output_tokens, known at offload time), its already-cached
prefix moves to the top level, and ordinary hits stop one level below the top (needs
levels >= 3). Analysis suggested short answers (tool calls, agent steps) are followed
sooner; in replay it did not pay (docs/policies.md), so it is off.

Defaults (sample=0.5, levels=2, ghost_ratio=8, protected_ratio=0.9, warm_hit=2) were chosen
on the first half (by time) of the Mooncake conversation trace; see docs/policies.md.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from typing import Iterator, Sequence

from .base import EVICTION, EvictionPolicy, RequestInfo, _NO_INFO
from .slotlist import SlotList

_NIL = -1
_DOOM, _UNS, _SAMP = 0, 1, 2   # list indices; protected levels follow


@EVICTION.register
class Cohort(EvictionPolicy):
    name = "cohort"

    def __init__(self, capacity: int, sample: float = 0.5, levels: int = 2, ghost_ratio: float = 8.0,
                 protected_ratio: float = 0.9, warm_hit: int = 2, short_output: int = 0, **params) -> None:
        super().__init__(capacity)
        if levels < 1:
            raise ValueError(f"cohort: levels must be >= 1, got {levels}")
        if not 0.0 <= sample <= 1.0:
            raise ValueError(f"cohort: sample must be in [0, 1], got {sample}")
        prev, nxt, member = [_NIL] * capacity, [_NIL] * capacity, [0] * capacity
        # 0 doomed, 1 unsampled cold, 2 sampled cold, 3.. protected levels 1..levels-1
        nl = 3 + (levels - 1)
        self.lists = [SlotList(capacity, prev, nxt, member, tag=i + 1) for i in range(nl)]
        self.member, self.nxt = member, nxt
        self.top = nl - 1
        self.quota = max(1, int(protected_ratio * capacity / max(1, levels - 1)))
        self.ghost: OrderedDict[bytes, int] = OrderedDict()
        self.ghost_cap = int(ghost_ratio * capacity)
        self.thresh = int(sample * 4294967296.0)
        self.warm_hit = warm_hit
        self.short_output = short_output
        self.slot_of: dict[bytes, int] = {}
        self._last_req = None
        self.hit_top = self.top - 1 if short_output and levels > 2 else self.top

    def _push(self, li: int, s: int) -> None:
        lists = self.lists
        lists[li].push(s)
        while li > _SAMP + 1 and lists[li].size > self.quota:
            h = lists[li].pop_head()
            li -= 1
            lists[li].push(h)
        if li == _SAMP + 1 and lists[li].size > self.quota:
            lists[_SAMP].push(lists[li].pop_head())

    def on_insert(self, slots: Sequence[int], keys: Sequence[bytes], info: RequestInfo = _NO_INFO) -> None:
        ghost, top, lists = self.ghost, self.top, self.lists
        n = len(slots)
        if n == 0:
            return
        start = info.start
        check_partial = bool(info.num_tokens and info.block_tokens)
        ks = info.keys
        hb = info.hit_blocks
        track = self.short_output > 0
        slot_of = self.slot_of
        if hb >= self.warm_hit:
            cold = _SAMP
        else:
            root = ks[hb] if hb < len(ks) else keys[0]
            cold = _SAMP if zlib.crc32(root) < self.thresh else _UNS
        for i in range(n - 1, -1, -1):
            s, k = slots[i], keys[i]
            if check_partial and not info.is_full(start + i):
                lists[_DOOM].push(s)
                continue
            if track:
                slot_of[k] = s
            lvl = ghost.pop(k, None)
            if lvl is None:
                lists[cold].push(s)
            else:
                self._push(min(max(lvl, _SAMP) + 1, top), s)
        ot = info.output_tokens
        if ot and ot < self.short_output and self._last_req is not ks:
            self._last_req = ks
            # a short answer (tool call, agent step): the next turn tends to come soon
            member = self.member
            full = len(ks) if not check_partial else min(len(ks), info.num_tokens // info.block_tokens)
            for j in range(min(full, info.hit_blocks) - 1, 0, -1):
                s = slot_of.get(ks[j])
                if s is None or member[s] == 0:
                    continue
                lists[member[s] - 1].unlink(s)
                self._push(top, s)

    def on_hit(self, slots: Sequence[int], info: RequestInfo = _NO_INFO) -> None:
        member, lists, top = self.member, self.lists, self.top
        for s in reversed(slots):
            t = member[s]
            if t == 0:
                continue
            li = t - 1
            lists[li].unlink(s)
            if li == _DOOM:
                lists[_SAMP].push(s)     # a partial block hit again (a repeated request)
            elif li <= _SAMP:
                self._push(min(_SAMP + 1, top), s)
            else:
                self._push(max(li, min(li + 1, self.hit_top)), s)

    def on_remove(self, slot: int, key: bytes) -> None:
        t = self.member[slot]
        if self.short_output and self.slot_of.get(key) == slot:
            del self.slot_of[key]
        if t:
            self.lists[t - 1].unlink(slot)
            if t > 1 and self.ghost_cap:
                g = self.ghost
                g[key] = t - 1
                if len(g) > self.ghost_cap:
                    g.popitem(last=False)

    def contains(self, slot: int) -> bool:
        return self.member[slot] != 0

    def victims(self, after: int | None = None) -> Iterator[int]:
        lists, nxt = self.lists, self.nxt
        t = self.member[after] if after is not None and after >= 0 else 0
        if t:
            li, s = t - 1, nxt[after]
        else:
            li, s = 0, lists[0].head
        while True:
            while s != _NIL:
                n = nxt[s]
                yield s
                s = n
            li += 1
            if li >= len(lists):
                return
            s = lists[li].head
