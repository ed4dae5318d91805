"""Tier sizing from a trace: the hit ratio at every capacity from one pass (`kvtier plan`).

Model. kvtier's `lru` keeps one recency order in which a request's blocks go to the top in
vLLM's order (block 0 most recent, its deepest block least), whatever the capacity; so a cache
of C blocks holds the C most recent blocks (LRU is a stack algorithm). A block's stack distance
d (its depth in that order before the request, 1 = most recent) says which caches hold it: those
of >= d blocks. Under the rules `kvtier replay` serves by (a request hits the longest cached
prefix of its full blocks, at least one token is left to compute; only full blocks are stored),
a request's hit length at capacity C is the number of leading blocks whose running max of d is
<= C. One pass over the trace gives the hit count at every capacity: a histogram of those
running maxima. Stack distances come from a Fenwick tree over touch times, compacted so that
memory stays proportional to the unique blocks.

Exactness. The curve equals `kvtier replay` with one `lru` tier at every capacity when, at every
capacity, the cached part of each request's blocks is a prefix (chained hash ids, as Mooncake's
and vLLM's are, give that) and no request re-sends a block-aligned prompt whose last block was
seen before (vLLM recomputes that block and kvtier leaves the stored copy where it was, so its
place in the order depends on the capacity). The pass counts both (`not_prefix`,
`capped_rerefs`); `exact` says whether both are 0.

Sampling (SHARDS, Waldspurger et al., FAST'15). Only blocks whose hash falls under the rate R
are tracked (memory ~ R x unique blocks); a sampled distance d stands for d / R blocks, and the
hit ratio at C is the share of the expected R x references that hit, the sample's surplus (or
shortfall) of references taken from (added to) its shortest distances (SHARDS-adj: a prefix
trace's hot blocks, its shared system prompts, sit there). The error is estimated from `GROUPS`
disjoint sub-samples (random groups): at each capacity the standard error is the spread of the
sub-sample curves / sqrt(GROUPS); the stated error is three of them. Capacities under 100 / R
blocks are not resolved. Sampling needs prefix-closed chains (chained ids).

Fleet. N instances, each with its own local tiers (an LRU stack over the requests routed to it),
and one shared tier: an LRU stack over what the instances miss locally at their configured
capacity (a shared hit refreshes a block, a miss writes it through), in arrival order.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Iterable, Sequence

import numpy as np

from kvtier.offline.trace import BLOCK_TOKENS, Request

GROUPS = 32              # sub-samples for the sampling error
MIN_SAMPLE_BLOCKS = 10_000  # a smaller sample gets a warning: its error is large on skewed traffic
ROUTINGS = ("random", "prefix")
PREFIX_SLACK = 1.25      # prefix routing: an instance past 1.25 x the mean load gets no affinity
_M64 = (1 << 64) - 1
_GOLD = 0x9E3779B97F4A7C15


class LruStack:
    """Stack distances in kvtier's `lru` order (vLLM's) over a stream of requests.

    Touch times: a request's blocks take the next times deepest first, so block 0 is the most
    recent. A Fenwick tree counts the times that are no longer a block's last touch; the depth
    of a block last touched at p, before a request starting at t, is t - p - (stale times > p)."""

    __slots__ = ("pos", "tree", "size", "t", "stale")

    def __init__(self) -> None:
        self.pos: dict[int, int] = {}       # block -> its last touch time
        self.size = 1 << 12
        self.tree = [0] * (self.size + 1)   # Fenwick tree of stale touch times (1-based)
        self.t = 0                          # the next touch time
        self.stale = 0

    def __len__(self) -> int:
        return len(self.pos)

    def _compact(self, room: int) -> None:
        """Renumber the live touch times 0..L-1 (order kept): memory stays O(blocks held)."""
        live = sorted(self.pos.items(), key=itemgetter(1))
        pos = self.pos
        for i, (b, _) in enumerate(live):
            pos[b] = i
        self.t = len(live)
        self.stale = 0
        self.size = max(1 << 12, 2 * (self.t + room))
        self.tree = [0] * (self.size + 1)

    def access(self, blocks: Sequence[int], touch: int, query: int) -> tuple[list[int], bool, bool]:
        """Distances before the request, then the touch of blocks[:touch] (blocks[0] ends on top).

        Returns the running max of the distances of blocks[:query] up to the first block never
        seen (1 = most recent), whether the seen blocks of blocks[:touch] fail to form a prefix of
        strictly increasing distances (not prefix-closed), and whether blocks[query] (query <
        touch: a block vLLM recomputes) was seen before."""
        if self.t + touch > self.size:
            self._compact(touch)
        pos, tree, t = self.pos, self.tree, self.t
        get = pos.get
        out: list[int] = []
        m = 0
        bad = False
        stale = self.stale
        for j in range(query):
            p = get(blocks[j])
            if p is None:
                break
            i = p + 1
            s = 0
            while i:
                s += tree[i]
                i &= i - 1
            d = t - p - stale + s
            if d <= m:
                bad = True
            else:
                m = d
            out.append(m)
        size = self.size
        seen_deeper = False
        capped = False
        for j in range(touch - 1, -1, -1):
            b = blocks[j]
            p = get(b)
            if p is not None:
                i = p + 1
                while i <= size:
                    tree[i] += 1
                    i += i & -i
                stale += 1
                seen_deeper = True
                if j == query:
                    capped = True
            elif seen_deeper:
                bad = True
            pos[b] = t
            t += 1
        self.t = t
        self.stale = stale
        return out, bad, capped


@dataclass
class Curve:
    """Hits at every capacity of one sample: `hist[m]` references hit at every capacity >= m /
    `scale` blocks; `refs` references in the sample, `expected` = scale x the trace's references
    (set after the pass; 0: `refs`)."""

    hist: list[int] = field(default_factory=lambda: [0])
    refs: int = 0
    scale: float = 1.0
    expected: float = 0.0
    adjust: bool = True   # SHARDS-adj (the local curve, where the hot blocks hit)

    def add(self, runmax: Iterable[int]) -> None:
        self._cum = None
        h = self.hist
        for m in runmax:
            if m >= len(h):
                h.extend([0] * (m + 1 - len(h) + len(h) // 2))
            h[m] += 1

    def ratio(self, caps: np.ndarray) -> np.ndarray:
        """Share of the references that hit at capacities `caps` (blocks). A sample that drew more
        (fewer) references than expected (a hot block in or out) has the difference taken from
        (added to) its shortest distances (SHARDS-adj), where a prefix trace's hot blocks are."""
        cum = getattr(self, "_cum", None)
        if cum is None:   # the curve is read many times once the pass is over
            cum = self._cum = np.cumsum(np.asarray(self.hist, dtype=np.int64))
        # a block d deep has 1 + Binomial(d - 1, scale) sampled blocks at or above it: d ~ 1 + (d_s - 1) / scale
        c = np.asarray(caps, dtype=np.float64)
        idx = np.where(c >= 1, np.floor(1 + (c - 1) * self.scale + 1e-9), 0).astype(np.int64)
        idx = np.minimum(idx, len(cum) - 1)
        expected = self.expected if self.adjust and self.expected else self.refs
        hits = np.where(idx >= 1, np.maximum(0.0, cum[np.maximum(idx, 0)] - (self.refs - expected)), 0.0)
        return np.minimum(hits / max(expected, 1e-300), 1.0)


@dataclass
class _Sample:
    """One sample of the blocks (all of them, the SHARDS sample, or one of its groups): each
    instance's local stack, the shared stack, and their curves."""

    scale: float
    instances: int
    local_capacity: int = 0
    local: list[LruStack] = field(default_factory=list)
    shared: LruStack | None = None
    curve: Curve = field(default_factory=Curve)
    shared_curve: Curve = field(default_factory=Curve)

    def __post_init__(self) -> None:
        self.local = [LruStack() for _ in range(self.instances)]
        self.curve.scale = self.shared_curve.scale = self.scale
        self.shared_curve.adjust = False
        if self.instances > 1:
            self.shared = LruStack()

    def request(self, inst: int, blocks: Sequence[int], touch: int, query: int, refs: int) -> tuple[bool, bool]:
        self.curve.refs += refs
        self.shared_curve.refs += refs
        rm, bad, capped = self.local[inst].access(blocks, touch, query)
        self.curve.add(rm)
        if self.shared is not None:
            lim = 1 + (self.local_capacity - 1) * self.scale   # as Curve.ratio maps capacities
            k = 0
            while k < len(rm) and rm[k] <= lim:
                k += 1
            srm, _, _ = self.shared.access(blocks[k:touch], touch - k, max(0, query - k))
            self.shared_curve.add(srm)
        return bad, capped


@dataclass
class Sizing:
    """The result of one pass: curves and what the trace is (see the module docstring)."""

    requests: int
    refs: int
    input_tokens: int
    block_tokens: int
    unique_blocks: int
    sample_rate: float
    main: _Sample
    groups: list[_Sample]
    instances: int
    routing: str | None
    local_capacity: int
    not_prefix: int
    capped_rerefs: int
    seconds: float
    per_instance_requests: list[int]

    @property
    def exact(self) -> bool:
        """Whether the one-tier curve is `kvtier replay`'s exactly (stack distances, no sampling,
        prefix-closed chains, no re-sent block-aligned prompt)."""
        return self.sample_rate >= 1.0 and not self.not_prefix and not self.capped_rerefs

    def hit_ratio(self, caps, shared: bool = False) -> np.ndarray:
        """Block hit ratio at capacities `caps`: of the local tiers (each instance's), or what the
        shared tier adds at those capacities (fleet)."""
        return (self.main.shared_curve if shared else self.main.curve).ratio(np.asarray(caps, dtype=np.float64))

    def resolution(self) -> int:
        """The smallest capacity (blocks) the sample resolves: 100 sampled blocks deep (1 exact)."""
        return 1 if self.sample_rate >= 1 else int(math.ceil(100 / self.sample_rate))

    def stderr(self, caps, shared: bool = False) -> np.ndarray:
        """Standard error of hit_ratio at `caps` from the sub-samples (0 without sampling)."""
        caps = np.asarray(caps, dtype=np.float64)
        if not self.groups:
            return np.zeros(caps.shape)
        g = np.array([(s.shared_curve if shared else s.curve).ratio(caps) for s in self.groups])
        return g.std(axis=0, ddof=1) / math.sqrt(len(self.groups))

    def error(self, shared: bool = False) -> float:
        """The stated sampling error of the hit ratio (0 exact): three standard errors, at most, over
        the capacities the sample resolves. Measured to hold for samples of >= MIN_SAMPLE_BLOCKS
        blocks; a smaller sample on skewed traffic (a few hot blocks) can miss by more."""
        if not self.groups:
            return 0.0
        grid = capacity_grid(max(1, self.unique_blocks))
        grid = grid[grid >= self.resolution()]
        if not len(grid):
            return 1.0
        return float(min(1.0, 3 * self.stderr(grid, shared).max()))

    @property
    def sample_blocks(self) -> int:
        """Blocks the sample holds (every block seen when exact)."""
        return len(self.main.local[0]) if self.instances == 1 else sum(len(s) for s in self.main.local)

    def hit_blocks(self, caps, shared: bool = False) -> np.ndarray:
        return self.hit_ratio(caps, shared) * self.refs


def capacity_grid(unique: int, points: int = 96) -> np.ndarray:
    """Capacities from 1 block to the unique blocks, log-spaced (distinct integers)."""
    g = np.unique(np.round(np.geomspace(1, max(1, unique), points)).astype(np.int64))
    return g


def _mix(b: int) -> int:
    """splitmix64's finalizer: a block id -> a uniform 64-bit hash (ids are often sequential)."""
    z = (b + _GOLD) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def make_router(n: int, routing: str, seed: int):
    """request blocks -> instance. random: uniform, seeded. prefix: the instance that last served
    the longest leading part of the request, unless it has served more than PREFIX_SLACK x the
    mean load (blocks), then the least loaded one."""
    if routing == "random":
        rng = random.Random(seed)

        def pick(h: Sequence[int], full: int) -> int:
            return rng.randrange(n)
        return pick
    owner: dict[int, int] = {}
    load = [0] * n

    def route(h: Sequence[int], full: int) -> int:
        best = -1
        for b in h[:full]:
            o = owner.get(b)
            if o is None:
                break
            best = o
        total = sum(load)
        if best < 0 or load[best] > PREFIX_SLACK * total / n:
            best = min(range(n), key=load.__getitem__)
        load[best] += max(1, full)
        for b in h[:full]:
            owner[b] = best
        return best
    return route


def measure(reqs: Iterable[Request], block_tokens: int = BLOCK_TOKENS, sample: float | None = None,
            instances: int = 1, routing: str = "random", local_capacity: int = 0, seed: int = 0) -> Sizing:
    """One pass over `reqs` (any iterable: a trace is streamed): the LRU curves (see the module).

    `sample`: SHARDS rate in (0, 1] (None or 1: every block, exact). `instances` > 1: fleet mode,
    `routing` random or prefix, each instance's local tiers holding `local_capacity` blocks in
    front of the shared tier."""
    if sample is not None and not 0 < sample <= 1:
        raise ValueError(f"sample rate must be in (0, 1], got {sample}")
    if instances < 1:
        raise ValueError(f"instances must be >= 1, got {instances}")
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    rate = 1.0 if sample is None or sample >= 1 else float(sample)
    bt = block_tokens
    main = _Sample(rate, instances, local_capacity)
    groups = [_Sample(rate / GROUPS, instances, local_capacity) for _ in range(GROUPS)] if rate < 1 else []
    thr = int(rate * (1 << 64))
    route = make_router(instances, routing, seed) if instances > 1 else None
    seen: set[int] | None = set() if instances > 1 else None
    per_inst = [0] * instances
    requests = refs = in_tok = not_prefix = capped_n = 0
    mix = _mix
    t0 = time.perf_counter()
    for r in reqs:
        h = r.hash_ids
        n = len(h)
        if not n:
            continue  # as replay: a request without blocks is not counted
        requests += 1
        refs += n
        inp = r.input_length
        in_tok += inp
        full = min(n, inp // bt)
        query = min(full, (inp - 1) // bt) if full else 0
        inst = route(h, full) if route is not None else 0
        per_inst[inst] += 1
        if rate >= 1:
            if seen is not None:
                seen.update(h[:full])
            bad, capped = main.request(inst, h, full, query, n)
        else:   # the sampled blocks: (position, block, its group)
            sel = [(j, b, x * GROUPS // thr) for j, b in enumerate(h) if (x := mix(b)) < thr]
            if not sel:
                continue
            blocks = [b for j, b, _ in sel if j < full]
            if seen is not None:
                seen.update(blocks)
            bad, capped = main.request(inst, blocks, len(blocks), sum(j < query for j, _, _ in sel), len(sel))
            for g in {g for _, _, g in sel}:
                part = [(j, b) for j, b, gg in sel if gg == g]
                gb = [b for j, b in part if j < full]
                groups[g].request(inst, gb, len(gb), sum(j < query for j, _ in part), len(part))
        not_prefix += bad
        capped_n += capped
    if seen is not None:
        unique = len(seen)
    else:
        unique = len(main.local[0])
    if rate < 1:
        unique = int(round(unique / rate))
    for smp in [main, *groups]:
        for c in (smp.curve, smp.shared_curve):
            c.expected = smp.scale * refs
    return Sizing(requests=requests, refs=refs, input_tokens=in_tok, block_tokens=bt, unique_blocks=unique,
                  sample_rate=rate, main=main, groups=groups, instances=instances,
                  routing=routing if instances > 1 else None, local_capacity=local_capacity,
                  not_prefix=not_prefix, capped_rerefs=capped_n, seconds=time.perf_counter() - t0,
                  per_instance_requests=per_inst)


BELADY_EXACT_REFS = 1_000_000   # Belady on more block references than this runs on a sample
BELADY_SAMPLE_REFS = 60_000     # about this many references in the sample
BELADY_GROUPS = 4               # disjoint sub-samples for its error


def belady_points(reqs: Sequence[Request], caps: Sequence[int], block_tokens: int,
                  refs: int | None = None) -> dict:
    """Belady's MIN hit ratio (replay's rules: full blocks, one token left) at capacities `caps`.

    Exact up to BELADY_EXACT_REFS references; above, on a spatial sample of the blocks (MIN is a
    stack algorithm, so SHARDS applies: the blocks whose hash falls under rate R, a cache of R x C
    blocks, the prefix rule over the sampled blocks of each request, as `measure` samples) of about
    BELADY_SAMPLE_REFS references. The stated error is three standard errors from BELADY_GROUPS
    disjoint sub-samples. Returns {"points": [{capacity_blocks, hit_ratio}], "sample_rate", "error"}."""
    from kvtier.offline.belady import belady, next_uses
    refs = refs if refs is not None else sum(len(r.hash_ids) for r in reqs)
    if refs <= BELADY_EXACT_REFS:
        nu = next_uses(reqs)
        return {"points": [{"capacity_blocks": c, "hit_ratio": belady(reqs, c, block_tokens, vllm=True, nu=nu)[
            "hit_ratio"]} for c in caps], "sample_rate": 1.0, "error": 0.0, "seconds": 0.0}
    t0 = time.perf_counter()
    rate = BELADY_SAMPLE_REFS / refs
    thr = int(rate * (1 << 64))
    bt = block_tokens
    parts: list[list[Request]] = [[] for _ in range(BELADY_GROUPS + 1)]   # the sample, then its groups
    counted = [0] * (BELADY_GROUPS + 1)
    for r in reqs:
        h = r.hash_ids
        if not h:
            continue
        inp = r.input_length
        full = min(len(h), inp // bt)
        query = min(full, (inp - 1) // bt) if full else 0
        sel = [(j, b, x * BELADY_GROUPS // thr) for j, b in enumerate(h) if (x := (b * _GOLD) & _M64) < thr]
        if not sel:
            continue
        for k, part in enumerate(parts):
            s = sel if k == 0 else [e for e in sel if e[2] == k - 1]
            if not s:
                continue
            counted[k] += len(s)
            ids = tuple(b for j, b, _ in s if j < full)
            q = sum(j < query for j, _, _ in s)
            if ids:   # one-token blocks: hits up to q of the len(ids) full sampled blocks
                part.append(Request(r.timestamp, q + 1, 0, ids))

    nus = [next_uses(p) for p in parts]   # shared by the capacities

    def ratio(k: int, c: int, scale: float) -> float:
        if not counted[k]:
            return 0.0
        return belady(parts[k], max(1, round(c * scale)), 1, vllm=True, nu=nus[k])["hit_blocks"] / counted[k]
    pts, errs = [], []
    for c in caps:
        hr = ratio(0, c, rate)
        g = [ratio(k, c, rate / BELADY_GROUPS) for k in range(1, BELADY_GROUPS + 1)]
        errs.append(3 * float(np.std(g, ddof=1)) / math.sqrt(BELADY_GROUPS))
        pts.append({"capacity_blocks": c, "hit_ratio": hr})
    return {"points": pts, "sample_rate": rate, "error": max(errs, default=0.0), "seconds": time.perf_counter() - t0}
