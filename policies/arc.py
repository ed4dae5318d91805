"""Adaptive Replacement Cache (Megiddo & Modha, FAST'03) over tier slots.

T1 holds blocks seen once recently, T2 blocks seen at least twice; B1/B2 are ghost key
histories of blocks evicted from T1/T2. A newcomer whose key is in B1 grows the target
size `p` of T1, one in B2 shrinks it; either enters T2. The cursor yields victims in ARC's
replacement order: from T1's head while T1 is larger than p, then T2, then the rest of T1.
A call's blocks are pushed tail-first (deepest first), as vLLM frees a request's blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterator, Sequence

from .base import EVICTION, EvictionPolicy, RequestInfo, NO_INFO
from .slotlist import NIL, SlotList


@EVICTION.register
class ARC(EvictionPolicy):
    name = "arc"

    def __init__(self, capacity: int, **params) -> None:
        super().__init__(capacity)
        prev, nxt, member = [NIL] * capacity, [NIL] * capacity, [0] * capacity
        self.t1 = SlotList(capacity, prev, nxt, member, tag=1)
        self.t2 = SlotList(capacity, prev, nxt, member, tag=2)
        self.b1: OrderedDict[bytes, None] = OrderedDict()
        self.b2: OrderedDict[bytes, None] = OrderedDict()
        self.p = 0.0

    def on_insert(self, slots: Sequence[int], keys: Sequence[bytes], info: RequestInfo = NO_INFO) -> None:
        c = self.capacity
        b1, b2, t1, t2 = self.b1, self.b2, self.t1, self.t2
        for s, k in zip(reversed(slots), reversed(keys)):  # tail-first: a request's deepest block leaves first
            if k in b1:
                self.p = min(float(c), self.p + max(1.0, len(b2) / len(b1)))
                del b1[k]
                t2.push(s)
            elif k in b2:
                self.p = max(0.0, self.p - max(1.0, len(b1) / len(b2)))
                del b2[k]
                t2.push(s)
            else:
                t1.push(s)
        # keep the directory within ARC's bounds: |T1|+|B1| <= c, |T1|+|T2|+|B1|+|B2| <= 2c
        while b1 and len(t1) + len(b1) > c:
            b1.popitem(last=False)
        while b2 and len(t1) + len(t2) + len(b1) + len(b2) > 2 * c:
            b2.popitem(last=False)

    def on_hit(self, slots: Sequence[int], info: RequestInfo = NO_INFO) -> None:
        t1, t2 = self.t1, self.t2
        member = t1.member
        for s in reversed(slots):
            tag = member[s]
            if tag == 1:
                t1.unlink(s)
                t2.push(s)
            elif tag == 2:
                t2.move_to_tail(s)

    def on_remove(self, slot: int, key: bytes) -> None:
        tag = self.t1.member[slot]
        if tag == 1:
            self.t1.unlink(slot)
            self.b1[key] = None
        elif tag == 2:
            self.t2.unlink(slot)
            self.b2[key] = None

    def contains(self, slot: int) -> bool:
        return self.t1.member[slot] != 0

    def _t1_count(self) -> int:
        """How many T1 head slots come before T2 in the order."""
        if len(self.t2) == 0:
            return len(self.t1)
        return max(0, len(self.t1) - int(self.p))

    def victims(self, after: int | None = None) -> Iterator[int]:
        # order: segment A = first n of T1, segment B = all of T2, segment C = rest of T1
        t1, t2, nxt = self.t1, self.t2, self.t1.nxt
        n = self._t1_count()
        tag = t1.member[after] if after is not None and after >= 0 else 0
        seg, s, i = 0, t1.head, 0
        if tag == 2:
            seg, s = 1, nxt[after]
        elif tag == 1:
            x, i = t1.head, 0
            while x != NIL and i < n and x != after:
                x, i = nxt[x], i + 1
            seg = 0 if (x == after and i < n) else 2
            s, i = nxt[after], i + 1
        c_start = NIL
        if seg == 0:
            while s != NIL and i < n:
                s2 = nxt[s]
                yield s
                s, i = s2, i + 1
            c_start = s
            s, seg = t2.head, 1
        elif seg == 1:
            c_start = t1.head
            for _ in range(n):
                if c_start == NIL:
                    break
                c_start = nxt[c_start]
        if seg == 1:
            while s != NIL:
                s2 = nxt[s]
                yield s
                s = s2
            s = c_start
        while s != NIL:
            s2 = nxt[s]
            yield s
            s = s2
