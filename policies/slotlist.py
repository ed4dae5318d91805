"""An intrusive doubly-linked list over slot ids: O(1) push, unlink, move; resumable walks."""

from __future__ import annotations

from typing import Iterator

_NIL = -1


class SlotList:
    """Slots 0..capacity-1; each slot is in at most one SlotList sharing `prev`/`nxt` arrays.

    Head is the eviction end (oldest), tail the newest.
    """

    __slots__ = ("prev", "nxt", "member", "head", "tail", "size", "tag")

    def __init__(self, capacity: int, prev: list[int] | None = None, nxt: list[int] | None = None,
                 member: list[int] | None = None, tag: int = 1) -> None:
        self.prev = prev if prev is not None else [_NIL] * capacity
        self.nxt = nxt if nxt is not None else [_NIL] * capacity
        self.member = member if member is not None else [0] * capacity
        self.tag = tag
        self.head = _NIL
        self.tail = _NIL
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def __contains__(self, slot: int) -> bool:
        return self.member[slot] == self.tag

    def push(self, slot: int) -> None:
        """Append at the tail (newest)."""
        t = self.tail
        self.prev[slot] = t
        self.nxt[slot] = _NIL
        if t == _NIL:
            self.head = slot
        else:
            self.nxt[t] = slot
        self.tail = slot
        self.member[slot] = self.tag
        self.size += 1

    def unlink(self, slot: int) -> None:
        p, n = self.prev[slot], self.nxt[slot]
        if p == _NIL:
            self.head = n
        else:
            self.nxt[p] = n
        if n == _NIL:
            self.tail = p
        else:
            self.prev[n] = p
        self.member[slot] = 0
        self.size -= 1

    def move_to_tail(self, slot: int) -> None:
        if self.tail != slot:
            self.unlink(slot)
            self.push(slot)

    def pop_head(self) -> int:
        s = self.head
        if s != _NIL:
            self.unlink(s)
        return s

    def iter_from(self, after: int | None = None) -> Iterator[int]:
        """Walk head -> tail, starting after `after` if it is a member, else from the head.

        The successor is read before yielding, so the caller may unlink the yielded slot.
        """
        s = self.nxt[after] if after is not None and after >= 0 and self.member[after] == self.tag else self.head
        nxt = self.nxt
        while s != _NIL:
            n = nxt[s]
            yield s
            s = n
