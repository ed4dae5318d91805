"""Learned hit density by conversation depth and age ("nextuse"): an online Belady approximation.

Belady keeps the blocks whose next use is nearest. Online, a block's next use is unknown, but
its distribution is learnable: in chained-prefix conversation traffic a block comes back when
its conversation's next turn arrives, with a probability and a gap that depend on how deep the
conversation already is. This policy learns, per class, the distribution of reuse ages and
ranks resident blocks by *hit density* (Beckmann et al., LHD, NSDI'18): expected future hits
divided by expected remaining block-time, given the block's class and current age.

- **Clock.** Ages are counted in inserted blocks (virtual time), so every knob is a ratio of
  the capacity and nothing depends on the trace's absolute times or load.
- **Classes.** A request continues a conversation when the deepest of its blocks already
  known (resident or in the ghost) is the last full block ("tip") of an earlier request; its
  turn depth is the tip's depth + 1 (else 0). A block's class is min(classes-1,
  max(turn depth, times the block was hit)): deep conversations and hot shared prefixes rank
  high, first turns low.
- **Statistics.** Each access starts a lifetime in the block's class; a reuse (resident hit,
  or a re-insert of a key found in the ghost) at age `a` counts a reuse in (class, bucket(a)).
  Lifetimes not reused within the horizon H = `ghost_ratio` x capacity count as ending at H.
  Counts are halved every 4 H. The ghost (the last H evicted keys with their class and access
  time) is what lets the policy see reuses beyond the cache's own reach.
- **Density.** For a block of class c in age bucket b (log2 buckets from capacity/16 to H):
  D = (reuses at ages >= edge_b) / (sum over those of (age - edge_b) + never-reused x (H - edge_b)).
  Recomputed every capacity/4 inserted blocks.
- **Order.** Cells (class, age bucket) are intrusive lists in access order; as time passes a
  cell's oldest blocks move to the next bucket (amortised: each block crosses each bucket edge
  once). Victims: partial last blocks first (doomed: their content changes next turn), then
  cells by ascending density (ties: older bucket first), each oldest first. A request's
  blocks are pushed deepest first (leaf-first), so a chain loses its tail before its root;
  with `request_order`, after a request inserts new blocks at chain position `start` > 0 its
  resident prefix moves behind them (each to its cell's tail), as vLLM frees a request
  tail-first. `classify="grid"` uses (continuation or not) x (hits) classes instead.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Iterator, Sequence

from .base import EVICTION, EvictionPolicy, RequestInfo, _NO_INFO
from .slotlist import _NIL, SlotList, walk_lists


@EVICTION.register
class NextUse(EvictionPolicy):
    name = "nextuse"

    def __init__(self, capacity: int, classes: int = 4, ghost_ratio: float = 8.0, doom_partial: bool = True,
                 leaf_first: bool = True, lifetimes: str = "horizon", request_order: bool = True,
                 classify: str = "max", **params) -> None:
        super().__init__(capacity)
        if classes < 1:
            raise ValueError(f"nextuse: classes must be >= 1, got {classes}")
        if ghost_ratio <= 0:
            raise ValueError(f"nextuse: ghost_ratio must be > 0, got {ghost_ratio}")
        if classify not in ("max", "grid"):
            raise ValueError(f"nextuse: classify must be 'max' or 'grid', got {classify!r}")
        self.grid = classify == "grid"
        if self.grid:   # (continuation or not) x (hits 0 .. classes-1)
            self.hc = classes
            classes = 2 * classes
        self.nc = classes
        self.H = max(2.0, ghost_ratio * capacity)
        # bucket edges: 0, C/16, C/8, ..., up to H; the last bucket is "beyond the horizon"
        base = max(1.0, capacity / 16.0)
        edges = [0.0]
        e = base
        while e < self.H:
            edges.append(e)
            e *= 2.0
        edges.append(self.H)
        self.edges = edges              # bucket b covers [edges[b], edges[b+1]); last: [H, inf)
        self.nb = len(edges)
        self._base = base
        nb, nc = self.nb, classes
        ncells = 1 + nc * nb            # list 0 = doomed
        prev, nxt, member = [_NIL] * capacity, [_NIL] * capacity, [0] * capacity
        self.lists = [SlotList(capacity, prev, nxt, member, tag=i + 1) for i in range(ncells)]
        self.member, self.nxt = member, nxt
        self.tacc = [0] * capacity      # virtual time of last access
        self.cls = [0] * capacity
        self.hits = [0] * capacity
        self.tip = [-1] * capacity      # turn depth if this block was a request's last full block
        self.slot_of: dict[bytes, int] = {}
        self.ghost: OrderedDict[bytes, tuple[int, int, int, int]] = OrderedDict()  # key -> (cls, tacc, tip, hits)
        self.ghost_cap = int(self.H)
        self.vt = 0
        self._aged_at = 0
        self._age_step = max(1.0, base / 8.0)  # an eighth of the narrowest bucket
        self.doom_partial = doom_partial
        self.leaf_first = leaf_first
        self.request_order = request_order
        if lifetimes not in ("horizon", "observed"):
            raise ValueError(f"nextuse: lifetimes must be 'horizon' or 'observed', got {lifetimes!r}")
        self.observed = lifetimes == "observed"
        self.R = [[0.0] * nb for _ in range(nc)]
        self.E = [[0.0] * nb for _ in range(nc)]   # observed mode: evictions by age bucket
        self.N = [0.0] * nc
        self._next_table = 0
        self._next_decay = int(4 * self.H)
        self._order = list(range(ncells))
        self._rank = list(range(ncells))
        self._req_id = None
        self._req_cls = 0
        self._mids = [0.5 * (edges[b] + edges[b + 1]) if b + 1 < nb else self.H for b in range(nb)]

    # ---- helpers -------------------------------------------------------------------------
    def _cls(self, d: int, h: int) -> int:
        if self.grid:
            hc = self.hc
            return (hc if d else 0) + (h if h < hc else hc - 1)
        c = d if d > h else h
        return c if c < self.nc else self.nc - 1

    def _bucket(self, age: int) -> int:
        if age < self._base:
            return 0
        b = 1 + int(math.log2(age / self._base))
        return b if b < self.nb else self.nb - 1

    def _request_depth(self, info: RequestInfo) -> int:
        """Turn depth of the request (0 = not a continuation); cached per request."""
        ks = info.keys
        rid = (id(ks), info.now, len(ks))
        if rid == self._req_id:
            return self._req_cls
        d = 0
        slot_of, ghost, tip = self.slot_of, self.ghost, self.tip
        for j in range(len(ks) - 1, -1, -1):
            k = ks[j]
            s = slot_of.get(k)
            if s is not None:
                t = tip[s]
                if t >= 0:
                    d = t + 1
                    tip[s] = -1     # a tip is continued once (a shared prefix is not a conversation)
                break
            g = ghost.get(k)
            if g is not None:
                if g[2] >= 0:
                    d = g[2] + 1
                    ghost[k] = (g[0], g[1], -1) + g[3:]
                break
        self._req_id, self._req_cls = rid, d
        return d

    def _tip_pos(self, info: RequestInfo) -> int:
        n = len(info.keys)
        if n and not info.is_full(n - 1):
            return n - 2
        return n - 1

    def _maybe_refresh(self) -> None:
        if self.vt >= self._next_decay:
            self._next_decay = self.vt + int(4 * self.H)
            for row in self.R + self.E:
                for b in range(len(row)):
                    row[b] *= 0.5
            self.N = [x * 0.5 for x in self.N]
        if self.vt >= self._next_table:
            self._next_table = self.vt + max(1, self.capacity // 4)
            self._recompute()

    def _recompute(self) -> None:
        nb, edges, mids, H = self.nb, self.edges, self._mids, self.H
        dens = [(-1.0, -1, 0)]  # doomed first
        for c in range(self.nc):
            if self.observed:
                row, ev = self.R[c], self.E[c]
                ha = ta = ca = 0.0
                for b in range(nb - 1, -1, -1):
                    ha += row[b]
                    cnt = row[b] + ev[b]
                    ca += cnt
                    ta += cnt * mids[b]
                    t = ta - ca * edges[b]
                    d = ha / t if t > 0 else 0.0
                    dens.append((d, -b, 1 + c * nb + b))
                continue
            row = self.R[c]
            tot_r = sum(row[:nb - 1])
            never = max(0.0, self.N[c] - tot_r)
            hits_after = 0.0
            time_after_mid = 0.0   # sum over reuses at >= b of mid
            for b in range(nb - 1, -1, -1):
                if b < nb - 1:
                    hits_after += row[b]
                    time_after_mid += row[b] * mids[b]
                a = edges[b]
                if b == nb - 1:
                    d = 0.0
                else:
                    t = (time_after_mid - hits_after * a) + never * (H - a)
                    d = hits_after / t if t > 0 else 0.0
                dens.append((d, -b, 1 + c * nb + b))
        dens.sort()
        self._order = [x[2] for x in dens]
        rank = [0] * len(self._order)
        for i, cell in enumerate(self._order):
            rank[cell] = i
        self._rank = rank

    def _age(self) -> None:
        """Move blocks whose age crossed their bucket's upper edge into the next bucket."""
        lists, nxt, tacc, vt, edges, nb = self.lists, self.nxt, self.tacc, self.vt, self.edges, self.nb
        for c in range(self.nc):
            off = 1 + c * nb
            for b in range(nb - 2, -1, -1):
                src = lists[off + b]
                lim = vt - edges[b + 1]
                h, last, k = src.head, _NIL, 0
                while h != _NIL and tacc[h] <= lim:
                    last, h, k = h, nxt[h], k + 1
                if k:
                    src.move_head_run(lists[off + b + 1], last, k)

    # ---- interface -----------------------------------------------------------------------
    def on_insert(self, slots: Sequence[int], keys: Sequence[bytes], info: RequestInfo = _NO_INFO) -> None:
        d = self._request_depth(info)
        tip_pos = self._tip_pos(info)
        start = info.start
        n = len(slots)
        self.vt += n
        vt = self.vt
        ghost, nc, nb, H, R = self.ghost, self.nc, self.nb, self.H, self.R
        hits, tip, cls, tacc, N = self.hits, self.tip, self.cls, self.tacc, self.N
        bt, ntok = info.block_tokens, info.num_tokens
        check_partial = self.doom_partial and ntok and bt   # then block pos is full iff (pos+1)*bt <= ntok
        self.slot_of.update(zip(keys, slots))
        c0 = d if d < nc else nc - 1        # the class of a block without history
        if self.grid:
            c0 = self.hc if d else 0
        first: list[int] = []               # new slots of c0's youngest cell, in push order
        other: dict[int, list[int]] = {}    # the other cells' new slots (keys are unique)
        for i in (range(n - 1, -1, -1) if self.leaf_first else range(n)):
            s, k = slots[i], keys[i]
            tacc[s] = vt
            if k in ghost:
                g = ghost.pop(k)
                age = vt - g[1]
                if age < H:
                    R[g[0]][self._bucket(age)] += 1.0
                    if self.observed and len(g) > 4:
                        e = self.E[g[0]]
                        e[g[4]] = max(0.0, e[g[4]] - 1.0)
                h = g[3] + 1
                hits[s] = h
                tip[s] = g[2]
                c = self._cls(d, h)
            else:
                hits[s] = 0
                tip[s] = -1
                c = c0
            if check_partial and (start + i + 1) * bt > ntok:
                cls[s] = 0
                other.setdefault(0, []).append(s)
                continue
            cls[s] = c
            N[c] += 1.0
            if c == c0:
                first.append(s)
            else:
                other.setdefault(1 + c * nb, []).append(s)
        if start <= tip_pos < start + n:
            tip[slots[tip_pos - start]] = d
        lists = self.lists
        lists[1 + c0 * nb].extend(first)
        for cell, run in other.items():
            lists[cell].extend(run)
        if start and self.request_order:
            # as vLLM frees a request tail-first: its new (deeper) blocks leave before its prefix,
            # so the prefix moves back behind them (each to the tail of its own cell)
            slot_of, member, ks = self.slot_of, self.member, info.keys
            for j in range(min(start, len(ks)) - 1, -1, -1):
                s = slot_of.get(ks[j])
                if s is not None:
                    t = member[s]
                    if t > 1:
                        lists[t - 1].move_to_tail(s)
                        tacc[s] = vt
        if vt - self._aged_at >= self._age_step:  # ages move in batches: each edge is wide
            self._aged_at = vt
            self._age()
        self._maybe_refresh()

    def on_hit(self, slots: Sequence[int], info: RequestInfo = _NO_INFO) -> None:
        d = self._request_depth(info) if info.keys else 0
        tip_pos = self._tip_pos(info) if info.keys else -1
        tip_key = info.keys[tip_pos] if tip_pos >= 0 else None
        member, lists, tacc, vt, nb, H, R = self.member, self.lists, self.tacc, self.vt, self.nb, self.H, self.R
        cls, hits, N = self.cls, self.hits, self.N
        ts = self.slot_of.get(tip_key) if tip_key is not None else None
        for s in (reversed(slots) if self.leaf_first else slots):
            t = member[s]
            if t == 0:
                continue
            lists[t - 1].unlink(s)
            if t > 1:
                age = vt - tacc[s]
                if age < H:
                    R[cls[s]][self._bucket(age)] += 1.0
            h = hits[s] + 1
            hits[s] = h
            if s == ts:
                self.tip[s] = d
            # placed like a new access (a doomed block, t == 1, reused after all too)
            c = self._cls(d, h)
            cls[s] = c
            tacc[s] = vt
            N[c] += 1.0
            lists[1 + c * nb].push(s)

    def on_remove(self, slot: int, key: bytes) -> None:
        self.on_remove_many((slot,), (key,))

    def on_remove_many(self, slots: Sequence[int], keys: Sequence[bytes]) -> None:
        member, lists, slot_of, ghost, cap = self.member, self.lists, self.slot_of, self.ghost, self.ghost_cap
        cls, tacc, tip, hits, observed = self.cls, self.tacc, self.tip, self.hits, self.observed
        for s, k in zip(slots, keys):
            t = member[s]
            if not t:
                continue
            lists[t - 1].unlink(s)
            slot_of.pop(k, None)
            if t == 1:
                continue  # doomed blocks leave no ghost
            c, ta = cls[s], tacc[s]
            if observed:
                b = self._bucket(self.vt - ta)
                self.E[c][b] += 1.0
                ghost[k] = (c, ta, tip[s], hits[s], b)
            else:
                ghost[k] = (c, ta, tip[s], hits[s])
            if len(ghost) > cap:
                ghost.popitem(last=False)

    def contains(self, slot: int) -> bool:
        return self.member[slot] != 0

    def take_victims(self, n: int, pinned: Sequence[int]) -> list[int]:
        out: list[int] = []
        if n <= 0:
            return out
        lists = self.lists
        for cell in self._order:  # the walk of victims(None), a list at a time: this runs per write-back
            n -= lists[cell].take(n, pinned, out)
            if not n:
                break
        return out

    def victims(self, after: int | None = None) -> Iterator[int]:
        return walk_lists(self.lists, self._order, self._rank, self.nxt, self.member, after)
