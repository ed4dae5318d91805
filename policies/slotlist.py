"""An intrusive doubly-linked list over slot ids: O(1) push, unlink, move; resumable walks."""

from __future__ import annotations

from typing import Iterable, Iterator, Sequence

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

    def unlink_many(self, slots: Sequence[int]) -> None:
        """unlink() each of `slots` (all members of this list), without the calls."""
        prev, nxt, member = self.prev, self.nxt, self.member
        head, tail = self.head, self.tail
        for s in slots:
            p, n = prev[s], nxt[s]
            if p == -1:  # _NIL
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
            if t == _NIL:
                self.head = s
            else:
                nxt[t] = s
            member[s] = tag
            t = s
            n += 1
        if n:
            nxt[t] = _NIL
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
            if p == _NIL:
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
            p, n = prev[s], nxt[s]   # s is not the tail, so n != _NIL
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

    def move_head_run(self, dst: "SlotList", last: int, count: int) -> None:
        """Move the first `count` slots (head .. `last`) to the tail of `dst`, in order."""
        prev, nxt, member, tag = self.prev, self.nxt, self.member, dst.tag
        first = self.head
        s = first
        for _ in range(count):
            member[s] = tag
            s = nxt[s]
        self.head = s
        if s == _NIL:
            self.tail = _NIL
        else:
            prev[s] = _NIL
        self.size -= count
        t = dst.tail
        prev[first] = t
        if t == _NIL:
            dst.head = first
        else:
            nxt[t] = first
        nxt[last] = _NIL
        dst.tail = last
        dst.size += count

    def take(self, n: int, pinned: Sequence[int], out: list[int]) -> int:
        """Append to `out` up to `n` slots, head first, whose `pinned` count is 0; returns how many."""
        if n <= 0:
            return 0
        nxt, append = self.nxt, out.append
        s, left = self.head, n
        while s != -1:  # _NIL, spelled as a constant in this hot loop
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


def unlink_members(lists: Sequence[SlotList], member: list[int], slots: Sequence[int]) -> None:
    """Unlink each slot of `slots` from the list it is in (lists[i] has tag i + 1, sharing
    `member`); non-members are skipped. Consecutive slots of one list go in one unlink_many."""
    run: list[int] = []
    cur = 0
    for s in slots:
        t = member[s]
        if t != cur:
            if run:
                lists[cur - 1].unlink_many(run)
                run = []
            cur = t
        if t:
            run.append(s)
    if run:
        lists[cur - 1].unlink_many(run)


def walk_lists(lists: Sequence[SlotList], order: Sequence[int], rank: Sequence[int], nxt: list[int],
               member: list[int], after: int | None = None) -> Iterator[int]:
    """Slots of `lists` (sharing `nxt`/`member`, tag i + 1 for lists[i]), the lists taken in
    `order`, each head to tail; resumes after slot `after` when it is in one of them (`rank[i]` is
    the position of list i in `order`), else starts at the first list's head."""
    t = member[after] if after is not None and after >= 0 else 0
    if t:
        oi, s = rank[t - 1], nxt[after]
    else:
        oi, s = 0, lists[order[0]].head
    n = len(order)
    while True:
        while s != _NIL:
            nx = nxt[s]
            yield s
            s = nx
        oi += 1
        if oi >= n:
            return
        s = lists[order[oi]].head
