"""An intrusive doubly-linked list over slot ids: O(1) push, unlink, move; resumable walks."""

from __future__ import annotations

from typing import Iterable, Iterator, Sequence

NIL = -1


class SlotList:
    """Slots 0..capacity-1; each slot is in at most one SlotList sharing `prev`/`nxt` arrays.

    Head is the eviction end (oldest), tail the newest.
    """

    __slots__ = ("prev", "nxt", "member", "head", "tail", "size", "tag")

    def __init__(self, capacity: int, prev: list[int] | None = None, nxt: list[int] | None = None,
                 member: list[int] | None = None, tag: int = 1) -> None:
        self.prev = prev if prev is not None else [NIL] * capacity
        self.nxt = nxt if nxt is not None else [NIL] * capacity
        self.member = member if member is not None else [0] * capacity
        self.tag = tag
        self.head = NIL
        self.tail = NIL
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def __contains__(self, slot: int) -> bool:
        return self.member[slot] == self.tag

    def push(self, slot: int) -> None:
        """Append at the tail (newest)."""
        t = self.tail
        self.prev[slot] = t
        self.nxt[slot] = NIL
        if t == NIL:
            self.head = slot
        else:
            self.nxt[t] = slot
        self.tail = slot
        self.member[slot] = self.tag
        self.size += 1

    def unlink(self, slot: int) -> None:
        p, n = self.prev[slot], self.nxt[slot]
        if p == NIL:
            self.head = n
        else:
            self.nxt[p] = n
        if n == NIL:
            self.tail = p
        else:
            self.prev[n] = p
        self.member[slot] = 0
        self.size -= 1

    def unlink_many(self, slots: Sequence[int]) -> None:
        """unlink() each of `slots` (all members of this list), without the calls."""
        prev, nxt, member = self.prev, self.nxt, self.member
        head, tail = self.head, self.tail
        for s in slots:
            p, n = prev[s], nxt[s]
            if p == -1:  # NIL
                head = n
            else:
                nxt[p] = n
            if n == -1:
                tail = p
            else:
                prev[n] = p
            member[s] = 0
        self.head, self.tail = head, tail
        self.size -= len(slots)

    def extend(self, slots: Iterable[int]) -> None:
        """Append `slots` at the tail, in order (one push each, without the calls)."""
        prev, nxt, member, tag = self.prev, self.nxt, self.member, self.tag
        t, n = self.tail, 0
        for s in slots:
            prev[s] = t
            if t == NIL:
                self.head = s
            else:
                nxt[t] = s
            member[s] = tag
            t = s
            n += 1
        if n:
            nxt[t] = NIL
            self.tail = t
            self.size += n

    def insert_run_before(self, anchor: int, slots: Sequence[int]) -> None:
        """Insert `slots` (non-members), in order, just before member `anchor` (nearer the head)."""
        if not slots:
            return
        prev, nxt, member, tag = self.prev, self.nxt, self.member, self.tag
        p = prev[anchor]
        for s in slots:
            prev[s] = p
            if p == NIL:
                self.head = s
            else:
                nxt[p] = s
            member[s] = tag
            p = s
        nxt[p] = anchor
        prev[anchor] = p
        self.size += len(slots)

    def move_run_to_tail(self, slots: Sequence[int]) -> None:
        """move_to_tail() each of `slots` (all members), in order, without the calls."""
        prev, nxt = self.prev, self.nxt
        head, tail = self.head, self.tail
        for s in slots:
            if s == tail:
                continue
            p, n = prev[s], nxt[s]   # s is not the tail, so n != NIL
            if p == -1:
                head = n
            else:
                nxt[p] = n
            prev[n] = p
            prev[s] = tail
            nxt[s] = -1
            nxt[tail] = s
            tail = s
        self.head, self.tail = head, tail

    def take(self, n: int, pinned: Sequence[int], out: list[int]) -> int:
        """Append to `out` up to `n` slots, head first, whose `pinned` count is 0; returns how many."""
        if n <= 0:
            return 0
        nxt, append = self.nxt, out.append
        s, left = self.head, n
        while s != -1:  # NIL, spelled as a constant in this hot loop
            if not pinned[s]:
                append(s)
                left -= 1
                if not left:
                    break
            s = nxt[s]
        return n - left

    def move_to_tail(self, slot: int) -> None:
        if self.tail != slot:
            self.unlink(slot)
            self.push(slot)

    def iter_from(self, after: int | None = None) -> Iterator[int]:
        """Walk head -> tail, starting after `after` if it is a member, else from the head.

        The successor is read before yielding, so the caller may unlink the yielded slot.
        """
        s = self.nxt[after] if after is not None and after >= 0 and self.member[after] == self.tag else self.head
        nxt = self.nxt
        while s != NIL:
            n = nxt[s]
            yield s
            s = n

