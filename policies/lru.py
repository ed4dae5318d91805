"""Least-recently-used eviction."""

from __future__ import annotations

from typing import Iterator, Sequence

from .base import EVICTION, EvictionPolicy, RequestInfo, _NO_INFO
from .slotlist import SlotList


@EVICTION.register
class LRU(EvictionPolicy):
    name = "lru"

    def __init__(self, capacity: int, **params) -> None:
        super().__init__(capacity)
        self._list = SlotList(capacity)

    def on_insert(self, slots: Sequence[int], keys: Sequence[bytes], info: RequestInfo = _NO_INFO) -> None:
        self._list.extend(slots)

    def on_hit(self, slots: Sequence[int], info: RequestInfo = _NO_INFO) -> None:
        mv = self._list.move_to_tail
        for s in slots:
            mv(s)

    def on_remove(self, slot: int, key: bytes) -> None:
        self._list.unlink(slot)

    def on_remove_many(self, slots: Sequence[int], keys: Sequence[bytes]) -> None:
        self._list.unlink_many(slots)

    def victims(self, after: int | None = None) -> Iterator[int]:
        return self._list.iter_from(after)

    def take_victims(self, n: int, pinned: Sequence[int]) -> list[int]:
        out: list[int] = []
        self._list.take(n, pinned, out)
        return out

    def contains(self, slot: int) -> bool:
        return slot in self._list
