"""Least-recently-used eviction, with a request's blocks ordered the way vLLM frees them.

vLLM's block pool frees a finished request's blocks tail-first (deepest block first) onto the
tail of its free queue and evicts from the head, so inside a request the deepest block leaves
first and a request longer than the cache keeps its prefix. The stack, the simulator and the
connector call ``on_hit(prefix)`` then ``on_insert(run)`` per contiguous run of new blocks,
each in chain order with ``RequestInfo.start`` = chain position; these policies reproduce
vLLM's order from those calls:

- ``order="vllm"`` (``lru`` and ``vllm_lru``): a call's slots are pushed tail-first, and the
  new runs of the request whose hit prefix was just touched go *before* that prefix (nearer
  the eviction head), as when vLLM frees the whole request ``reversed(blocks)`` at once.
- ``order="call"``: tail-first inside each call only (no per-request state).
- ``order="chain"``: chain order (head-first), kvtier's LRU before issue 12; kept to measure.
"""

from __future__ import annotations

from typing import Iterator, Sequence

from .base import EVICTION, EvictionPolicy, RequestInfo, NO_INFO
from .slotlist import NIL, SlotList

_ORDERS = ("vllm", "call", "chain")


def request_id(info: RequestInfo):
    """Identity of the request a call belongs to: its request_id when the caller sets one (the
    connector, replay), else its keys list, which is only sound while every request's list stays
    alive (a freed list's id() is reused by the next request)."""
    if info.request_id is not None:
        return info.request_id
    ks = info.keys
    return (id(ks), len(ks), info.now) if ks else None


@EVICTION.register
class LRU(EvictionPolicy):
    name = "lru"

    def __init__(self, capacity: int, order: str = "vllm", doom_partial: bool = False, **params) -> None:
        super().__init__(capacity)
        if order not in _ORDERS:
            raise ValueError(f"{self.name}: order must be one of {_ORDERS}, got {order!r}")
        self._list = SlotList(capacity)
        self._doom = doom_partial
        self._order = order
        self._req = None          # request of the last call, and the head-most slot of its blocks
        self._anchor = NIL

    def on_insert(self, slots: Sequence[int], keys: Sequence[bytes], info: RequestInfo = NO_INFO) -> None:
        order = self._order
        if order == "chain":
            self._list.extend(slots)
            return
        run = slots[::-1]
        if self._doom and info.num_tokens and info.block_tokens and \
                (info.start + len(slots)) * info.block_tokens > info.num_tokens:
            # the partial last block changes content next turn: first victim (list head)
            s0 = run[0]
            run = run[1:]
            h = self._list.head
            if h == NIL:
                self._list.push(s0)
            else:
                self._list.insert_run_before(h, [s0])
            if not run:
                return
        if order == "vllm":
            rid = request_id(info)
            a = self._anchor
            if rid is not None and rid == self._req and a != NIL:
                self._list.insert_run_before(a, run)
            else:
                self._list.extend(run)
                self._req = rid
            self._anchor = run[0] if run else a
            return
        self._list.extend(run)

    def on_hit(self, slots: Sequence[int], info: RequestInfo = NO_INFO) -> None:
        if self._order == "chain":
            self._list.move_run_to_tail(slots)
            return
        self._list.move_run_to_tail(slots[::-1])
        if self._order == "vllm" and slots:
            self._req = request_id(info)
            self._anchor = slots[-1]

    def on_remove(self, slot: int, key: bytes) -> None:
        self._list.unlink(slot)
        if slot == self._anchor:
            self._anchor = self._list.nxt[slot]

    def on_remove_many(self, slots: Sequence[int], keys: Sequence[bytes]) -> None:
        self._list.unlink_many(slots)
        a, member, nxt = self._anchor, self._list.member, self._list.nxt
        while a != NIL and not member[a]:  # the anchor left: its successor (removed slots keep nxt)
            a = nxt[a]
        self._anchor = a

    def victims(self, after: int | None = None) -> Iterator[int]:
        return self._list.iter_from(after)

    def take_victims(self, n: int, pinned: Sequence[int]) -> list[int]:
        out: list[int] = []
        self._list.take(n, pinned, out)
        return out

    def contains(self, slot: int) -> bool:
        return slot in self._list


@EVICTION.register
class VllmLRU(LRU):
    """The yardstick: exactly vLLM's prefix-cache eviction order (``lru`` with order="vllm")."""

    name = "vllm_lru"

    def __init__(self, capacity: int, **params) -> None:
        super().__init__(capacity, order="vllm")
