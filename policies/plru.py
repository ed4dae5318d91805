"""Prefix-aware segmented LRU in vLLM's order ("plru"): cheap, and never far from vLLM's LRU.

Three lists over the tier's slots, evicted in this order, each head first:

- **doomed**: the partial last block of a request (``RequestInfo.is_full`` false). Its tokens
  change when the conversation grows, so its chained hash is never asked for again.
- **probation**: blocks not hit since they were inserted, in vLLM's order: a request's blocks
  tail-first, its new runs before its own older blocks (see ``lru``).
- **protected**: blocks hit at least once (a conversation came back, or a shared prefix was
  reused), at most ``protect`` x capacity; beyond that the protected head drops back to the
  probation tail, so a stale hot block ages out through one more LRU pass.

Per tracked slot it keeps the three SlotList words (prev, next, list tag): no key map, no ghost.
"""

from __future__ import annotations

from typing import Iterator, Sequence
from zlib import crc32

from .base import EVICTION, EvictionPolicy, RequestInfo, _NO_INFO
from .lru import request_id
from .slotlist import _NIL, SlotList, unlink_members, walk_lists

_DOOM, _PROB, _PROT = 0, 1, 2


@EVICTION.register
class PrefixLRU(EvictionPolicy):
    name = "plru"

    def __init__(self, capacity: int, protect: float = 0.25, doom_partial: bool = True, adapt: bool = True,
                 max_protect: float = 0.9, **params) -> None:
        super().__init__(capacity)
        if not 0.0 <= protect < 1.0:
            raise ValueError(f"plru: protect must be in [0, 1), got {protect}")
        prev, nxt, member = [_NIL] * capacity, [_NIL] * capacity, [0] * capacity
        self.lists = [SlotList(capacity, prev, nxt, member, tag=i + 1) for i in range(3)]
        self.member, self.nxt = member, nxt
        self.quota = float(int(protect * capacity))
        self.qmax = int(max_protect * capacity)
        self.adapt = adapt
        # ghost: crc32(key) -> (evicted before or after a hit, eviction epoch), 2 bytes per cell
        self.gm = max(64, 2 * capacity)
        self.gtag = bytearray(self.gm)
        self.gep = bytearray(self.gm)
        self._evicted = 0
        self._ep_len = max(1, capacity // 4)
        self.was = bytearray(capacity)  # 1 once a block was hit (protected at least once)
        self._gn = [0.0, 0.0]          # recent evictions from probation, protected
        self._gep_last = 0
        self.doom = doom_partial
        self._order, self._rank = [0, 1, 2], [0, 1, 2]
        self._req = None
        self._anchor = _NIL        # head-most probation slot of the last request's blocks

    def on_insert(self, slots: Sequence[int], keys: Sequence[bytes], info: RequestInfo = _NO_INFO) -> None:
        if not slots:
            return
        run = slots[::-1]                       # tail-first
        lists = self.lists
        was = self.was
        for s in slots:
            was[s] = 0
        if self.doom and info.num_tokens and info.block_tokens and \
                (info.start + len(slots)) * info.block_tokens > info.num_tokens:
            lists[_DOOM].push(run[0])
            run = run[1:]
            if not run:
                return
        if self.adapt:
            self._ghost_hits(keys)
        prob = lists[_PROB]
        rid = request_id(info)
        a = self._anchor
        if rid is not None and rid == self._req and a != _NIL and self.member[a] == _PROB + 1:
            prob.insert_run_before(a, run)      # deeper than the request's own earlier blocks
        else:
            prob.extend(run)
            self._req = rid
        self._anchor = run[0]

    def _ghost_hits(self, keys: Sequence[bytes]) -> None:
        """ARC's adaptation: a miss on a key evicted from probation shrinks the protected quota,
        one evicted from protected grows it (one block per ghost hit)."""
        gtag, gep, gm = self.gtag, self.gep, self.gm
        ep = (self._evicted // self._ep_len) & 0xFF
        q = self.quota
        n1, n2 = self._gn[0] + 1.0, self._gn[1] + 1.0
        for k in keys:
            i = crc32(k) % gm
            t = gtag[i]
            if t and ((ep - gep[i]) & 0xFF) <= 4:
                if t == _PROB + 1:
                    q = max(0.0, q - max(1.0, n2 / n1))
                else:
                    q = min(self.qmax, q + max(1.0, n1 / n2))
                gtag[i] = 0
        self.quota = q

    def _ghost_add(self, slots: Sequence[int], keys: Sequence[bytes]) -> None:
        gtag, gep, gm, member = self.gtag, self.gep, self.gm, self.member
        self._evicted += len(slots)
        ep = (self._evicted // self._ep_len) & 0xFF
        gn = self._gn
        if ep != self._gep_last:       # evictions per list over about the ghost's horizon
            self._gep_last = ep
            gn[0] *= 0.75
            gn[1] *= 0.75
        was = self.was
        for s, k in zip(slots, keys):
            if member[s] > 1:              # not a doomed block
                t = 2 + was[s]             # evicted before / after it was ever hit
                i = crc32(k) % gm
                gtag[i] = t
                gep[i] = ep
                gn[t - 2] += 1.0

    def on_hit(self, slots: Sequence[int], info: RequestInfo = _NO_INFO) -> None:
        lists, member = self.lists, self.member
        prot = lists[_PROT]
        was = self.was
        for s in slots:
            was[s] = 1
        for s in reversed(slots):
            t = member[s]
            if t == _PROT + 1:
                prot.move_to_tail(s)
            elif t:
                lists[t - 1].unlink(s)
                prot.push(s)
        q = self.quota
        if prot.size > q:                      # over quota: the oldest protected go back to probation
            prob = lists[_PROB]
            while prot.size > q:
                prob.push(prot.pop_head())
        self._req = request_id(info)
        a = slots[-1] if slots else _NIL        # the deepest hit block, if it fell back to probation
        self._anchor = a if a != _NIL and member[a] == _PROB + 1 else _NIL

    def on_remove(self, slot: int, key: bytes) -> None:
        if self.adapt:
            self._ghost_add((slot,), (key,))
        t = self.member[slot]
        if t:
            self.lists[t - 1].unlink(slot)
        if slot == self._anchor:
            self._anchor = self.nxt[slot]

    def on_remove_many(self, slots: Sequence[int], keys: Sequence[bytes]) -> None:
        if self.adapt:
            self._ghost_add(slots, keys)
        member = self.member
        unlink_members(self.lists, member, slots)
        a, nxt = self._anchor, self.nxt
        while a != _NIL and not member[a]:
            a = nxt[a]
        self._anchor = a

    def victims(self, after: int | None = None) -> Iterator[int]:
        return walk_lists(self.lists, self._order, self._rank, self.nxt, self.member, after)

    def take_victims(self, n: int, pinned: Sequence[int]) -> list[int]:
        out: list[int] = []
        for lst in self.lists:
            if n <= 0:
                break
            n -= lst.take(n, pinned, out)
        return out

    def contains(self, slot: int) -> bool:
        return self.member[slot] != 0
