"""S3-FIFO (Yang et al., SOSP'23) over tier slots.

Three FIFO queues: a small probationary queue S (`small_ratio` of capacity, default 10%),
a main queue M, and a ghost queue G of keys recently evicted from S (as many keys as the
capacity). A newcomer whose key is in G enters M, otherwise S. Hits only bump a 2-bit
frequency. Eviction: while S holds more than its share, S's head leaves if it was never hit
(its key goes to G), or moves to M if it was; otherwise M's head leaves if its frequency is 0,
or is reinserted at M's tail with the frequency decremented. The cursor performs those moves
lazily as it walks and yields only the blocks that would leave.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterator, Sequence

from .base import EVICTION, EvictionPolicy, RequestInfo, NO_INFO
from .slotlist import NIL, SlotList


@EVICTION.register
class S3FIFO(EvictionPolicy):
    name = "s3fifo"

    def __init__(self, capacity: int, small_ratio: float = 0.1, ghost_ratio: float = 1.0,
                 max_freq: int = 3, **params) -> None:
        super().__init__(capacity)
        if not 0.0 < small_ratio < 1.0:
            raise ValueError(f"s3fifo: small_ratio must be in (0, 1), got {small_ratio}")
        prev, nxt, member = [NIL] * capacity, [NIL] * capacity, [0] * capacity
        self.small = SlotList(capacity, prev, nxt, member, tag=1)
        self.main = SlotList(capacity, prev, nxt, member, tag=2)
        self.freq = bytearray(capacity)
        self.small_target = max(1, int(small_ratio * capacity))
        self.ghost_cap = max(1, int(ghost_ratio * capacity))
        self.ghost: OrderedDict[bytes, None] = OrderedDict()
        self.max_freq = max_freq

    def on_insert(self, slots: Sequence[int], keys: Sequence[bytes], info: RequestInfo = NO_INFO) -> None:
        ghost, freq = self.ghost, self.freq
        for s, k in zip(reversed(slots), reversed(keys)):  # tail-first, as vLLM frees a request's blocks
            freq[s] = 0
            if k in ghost:
                del ghost[k]
                self.main.push(s)
            else:
                self.small.push(s)

    def on_hit(self, slots: Sequence[int], info: RequestInfo = NO_INFO) -> None:
        freq, m = self.freq, self.max_freq
        for s in slots:
            if freq[s] < m:
                freq[s] += 1

    def on_remove(self, slot: int, key: bytes) -> None:
        tag = self.small.member[slot]
        if tag == 1:
            self.small.unlink(slot)
            g = self.ghost
            g[key] = None
            if len(g) > self.ghost_cap:
                g.popitem(last=False)
        elif tag == 2:
            self.main.unlink(slot)

    def contains(self, slot: int) -> bool:
        return self.small.member[slot] != 0

    def victims(self, after: int | None = None) -> Iterator[int]:
        small, main, freq = self.small, self.main, self.freq
        nxt, member = small.nxt, small.member
        tag = member[after] if after is not None and after >= 0 else 0
        ss = nxt[after] if tag == 1 else small.head
        ms = nxt[after] if tag == 2 else main.head
        vs = len(small)  # S size as the walk sees it (yielded or moved slots leave it)
        target = self.small_target
        while ss != NIL or ms != NIL:
            if ss != NIL and (vs > target or ms == NIL):
                s = ss
                ss = nxt[s]
                vs -= 1
                if freq[s] > 0:  # hit while on probation: promote to M
                    small.unlink(s)
                    freq[s] = 0
                    main.push(s)
                    if ms == NIL:
                        ms = s
                    continue
                yield s
            else:
                s = ms
                ms = nxt[s]
                if freq[s] > 0:  # second chance in M
                    freq[s] -= 1
                    main.move_to_tail(s)
                    if ms == NIL:
                        ms = s
                    continue
                yield s
