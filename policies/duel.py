"""Online choice between two eviction policies by their regret ("duel", after LeCaR).

Both experts see every call, so each keeps its own victim order over the same resident slots;
the tier's cursor walks the order of the expert in charge. Each eviction is charged to the
expert that chose it, in a hashed ghost (2 bytes per cell, about ``ghost_ratio`` x capacity
cells): a later miss on a key that expert A evicted is a *regret* of A. The expert with the
lower recent regret rate (regrets per eviction it made, halved every ``capacity`` evictions)
is in charge; the other still makes every ``explore``-th eviction batch, so its rate stays
measured. No per-trace tuning: the experts are chosen by name, and the choice adapts online.
"""

from __future__ import annotations

from typing import Iterator, Sequence
from zlib import crc32

from .base import EVICTION, EvictionPolicy, RequestInfo, _NO_INFO


@EVICTION.register
class Duel(EvictionPolicy):
    name = "duel"

    def __init__(self, capacity: int, experts: str = "nextuse,vllm_lru", ghost_ratio: float = 2.0,
                 explore: int = 8, prefix_regret: bool = False, **params) -> None:
        super().__init__(capacity)
        names = [x.strip() for x in experts.replace("+", ",").split(",")]
        if len(names) != 2 or "duel" in names:
            raise ValueError(f"duel: experts must name two other policies, got {experts!r}")
        self.experts = [EVICTION.get(n)(capacity) for n in names]
        self.names = names
        self.gm = max(64, int(ghost_ratio * capacity))
        self.gtag = bytearray(self.gm)       # 0 empty, 1 + index of the expert that evicted it
        self.gep = bytearray(self.gm)        # eviction epoch (mod 256)
        self.ev = [1.0, 1.0]                 # recent evictions made by each expert
        self.rg = [0.0, 0.0]                 # recent regrets of each expert
        self.cur = 0
        self.explore_every = max(2, int(explore))
        self.prefix_regret = prefix_regret
        self._batch = 0
        self._evicted = 0
        self._ep_len = max(1, capacity // 2)
        self._horizon = max(1, int(2 * ghost_ratio))   # ghost entries older than this many epochs are stale
        self._last_ep = 0

    def _who(self) -> int:
        """The expert in charge of the next eviction batch (a function of state, so repeated
        walks agree): every explore-th batch goes to the other expert."""
        if self._batch % self.explore_every == self.explore_every - 1:
            return 1 - self.cur
        return self.cur

    def _update(self) -> None:
        r0, r1 = self.rg[0] / self.ev[0], self.rg[1] / self.ev[1]
        self.cur = 0 if r0 <= r1 else 1

    def on_insert(self, slots: Sequence[int], keys: Sequence[bytes], info: RequestInfo = _NO_INFO) -> None:
        gtag, gep, gm = self.gtag, self.gep, self.gm
        ep = (self._evicted // self._ep_len) & 0xFF
        hz = self._horizon
        rg = self.rg
        hit = False
        prefix = self.prefix_regret and info.start == info.hit_blocks
        for k in keys:
            i = crc32(k) % gm
            t = gtag[i]
            if t and ((ep - gep[i]) & 0xFF) <= hz:
                rg[t - 1] += 1.0
                gtag[i] = 0
                hit = True
            elif prefix:
                break   # deeper ghost keys could not have hit without this one
        if hit:
            self._update()
        for e in self.experts:
            e.on_insert(slots, keys, info)

    def on_hit(self, slots: Sequence[int], info: RequestInfo = _NO_INFO) -> None:
        for e in self.experts:
            e.on_hit(slots, info)

    def _charge(self, keys: Sequence[bytes], who: int) -> None:
        self._evicted += len(keys)
        ep = (self._evicted // self._ep_len) & 0xFF
        if ep != self._last_ep:              # age the rates
            self._last_ep = ep
            self.ev = [x * 0.5 + 0.5 for x in self.ev]
            self.rg = [x * 0.5 for x in self.rg]
        self.ev[who] += len(keys)
        gtag, gep, gm, t = self.gtag, self.gep, self.gm, who + 1
        for k in keys:
            i = crc32(k) % gm
            gtag[i] = t
            gep[i] = ep

    def on_remove(self, slot: int, key: bytes) -> None:
        self.on_remove_many((slot,), (key,))

    def on_remove_many(self, slots: Sequence[int], keys: Sequence[bytes]) -> None:
        self._charge(keys, self._who())
        self._batch += 1
        for e in self.experts:
            e.on_remove_many(slots, keys)

    def victims(self, after: int | None = None) -> Iterator[int]:
        return self.experts[self._who()].victims(after)

    def take_victims(self, n: int, pinned: Sequence[int]) -> list[int]:
        return self.experts[self._who()].take_victims(n, pinned)

    def contains(self, slot: int) -> bool:
        return self.experts[0].contains(slot)
