"""Chained-prefix-aware segmented LRU ("pslru").

Reuse in chained-prefix KV caches is dominated by two things: hot shared prefixes (system
prompts, shared documents) that come back many times, and conversation turns that come back
after a long gap, re-reading the whole previous turn. Most blocks are never reused at all.

Structure: `levels` LRU segments L0 (probation) .. L{K-1} (most protected) plus a "doomed"
list evicted before anything else. The levels above L0 share `protected_ratio` of the
capacity equally; a level over its quota demotes its head one level down (so frequency ages
out). Victim order is the
concatenation doomed, L0, L1, ..., L{K-1} (each head to tail).

- insert: a partial last block (RequestInfo.is_full false) goes to doomed: its content
  changes in the next turn, so it is almost never reused. A key found in the ghost history
  (evicted not long ago) re-enters at the level it left from plus one (it has proved reuse
  beyond the cache's reach); others enter L0.
- hit: each hit block moves up one level.
- leaf-first: a request's blocks are pushed deepest first, so within a level the descendants
  sit nearer the head than their ancestors and leave first; a block without its parent is
  useless under the prefix rule.
- ghost: the last `ghost_ratio` x capacity evicted keys with their level.

Defaults (levels=2, ghost_ratio=8, protected_ratio=0.9) were chosen on the first half (by
time) of the Mooncake conversation trace among levels {2, 4} x ghost {2, 8, 16, 64} x
protected {0.75, 0.9, 0.97}; see docs/policies.md.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterator, Sequence

from .base import EVICTION, EvictionPolicy, RequestInfo, _NO_INFO
from .slotlist import _NIL, SlotList, walk_lists


@EVICTION.register
class PrefixSLRU(EvictionPolicy):
    name = "pslru"

    def __init__(self, capacity: int, levels: int = 2, ghost_ratio: float = 8.0, protected_ratio: float = 0.9,
                 doom_partial: bool = True, leaf_first: bool = True, **params) -> None:
        super().__init__(capacity)
        if levels < 1:
            raise ValueError(f"pslru: levels must be >= 1, got {levels}")
        prev, nxt, member = [_NIL] * capacity, [_NIL] * capacity, [0] * capacity
        # list 0 = doomed, list i+1 = level i
        self.lists = [SlotList(capacity, prev, nxt, member, tag=i + 1) for i in range(levels + 1)]
        self.member = member
        self.nxt = nxt
        self.levels = levels
        self.quota = max(1, int(protected_ratio * capacity / max(1, levels - 1)))
        self.ghost: OrderedDict[bytes, int] = OrderedDict()
        self.ghost_cap = int(ghost_ratio * capacity)
        self.doom_partial = doom_partial
        self.leaf_first = leaf_first

    def _push(self, li: int, s: int) -> None:
        lists = self.lists
        lists[li].push(s)
        # levels above L0 are bounded: demote heads down a level
        while li > 1 and lists[li].size > self.quota:
            h = lists[li].pop_head()
            li -= 1
            lists[li].push(h)

    def on_insert(self, slots: Sequence[int], keys: Sequence[bytes], info: RequestInfo = _NO_INFO) -> None:
        ghost, top = self.ghost, self.levels
        n = len(slots)
        order = range(n - 1, -1, -1) if self.leaf_first else range(n)
        start = info.start
        check_partial = self.doom_partial and info.num_tokens and info.block_tokens
        for i in order:
            s, k = slots[i], keys[i]
            if check_partial and not info.is_full(start + i):
                self.lists[0].push(s)
                continue
            lvl = ghost.pop(k, None)
            if lvl is None:
                self._push(1, s)
            else:
                self._push(min(lvl + 1, top), s)

    def on_hit(self, slots: Sequence[int], info: RequestInfo = _NO_INFO) -> None:
        member, lists, top = self.member, self.lists, self.levels
        order = reversed(slots) if self.leaf_first else slots
        for s in order:
            t = member[s]
            if t == 0:
                continue
            li = t - 1
            lists[li].unlink(s)
            self._push(min(li + 1, top) if li else 1, s)

    def on_remove(self, slot: int, key: bytes) -> None:
        t = self.member[slot]
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
        order = range(len(self.lists))
        return walk_lists(self.lists, order, order, self.nxt, self.member, after)
