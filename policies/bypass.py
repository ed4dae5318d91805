"""Adaptive bypass of a request's deep tail ("bypass"): admission chosen online by shadow caches.

A request whose missing run is a large share of the cache flushes it whatever the eviction
order: the store evicts every unpinned block to write the run's prefix. On traffic where that
happens (long agent contexts in a small cache), Belady keeps the blocks of the requests that
come back soon and bypasses the rest; LRU keeps the newest request's prefix. Capping what one
request may write (its first ``f`` x capacity missing blocks) is worth a lot there (+30-40% of
the gap on agent traffic at 1%) and costs hits elsewhere when ``f`` is too small, so ``f`` is
chosen online, per workload and per cache size, by miniature simulation (Waldspurger et al.,
ATC'17; SHARDS spatial sampling):

- Keys are sampled by a hash (rate R = min(1, ``shadow_blocks`` / capacity)); each candidate
  ``f`` of ``fractions`` has a shadow LRU of R x capacity sampled keys in vLLM's order (a
  request's blocks tail-first), replaying the same requests with its own cap.
- A shadow's hit for a request is its longest run of leading sampled keys it holds (the prefix
  rule on the sample); its misses at chain positions below (first missing position + f x
  capacity) are admitted.
- Scores are the shadows' hits, halved every ``window`` x shadow size sampled references; the
  real tier admits with the ``f`` of the best shadow (hysteresis ``margin``), starting at the
  first candidate (1.0: everything, like vLLM), and goes back to it while the best does not
  beat it by ``min_gain`` (a small shadow gain is sampling noise, and each switch costs).

Memory: each shadow holds R x capacity keys (an OrderedDict entry, about 100 bytes, so at most
``len(fractions)`` x ``shadow_blocks`` entries: bounded, not per tracked block). The tier's
capacity comes from the builder (``wants_capacity``); without it every block is admitted.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence
from zlib import crc32

from .base import ADMISSION, AdmissionPolicy, RequestInfo, _NO_INFO
from .lru import request_id


@ADMISSION.register
class ShadowBypass(AdmissionPolicy):
    name = "bypass"
    wants_capacity = True   # the builder passes the tier's capacity_blocks as `capacity`

    def __init__(self, capacity: int | None = None, fractions: str = "1,0.25,0.125,0.0625,16b,4b", shadow_blocks: int = 256,
                 window: float = 4.0, margin: float = 0.02, min_gain: float = 0.05, **params) -> None:
        super().__init__(**params)
        fs = [x.strip() for x in str(fractions).split(",") if x.strip()]
        try:   # "0.25": a share of the capacity; "16b": 16 blocks
            vals = [(float(x[:-1]), True) if x.endswith("b") else (float(x), False) for x in fs]
        except ValueError:
            vals = []
        if not vals or any(v <= 0 for v, _ in vals):
            raise ValueError(f"bypass: fractions must be positive numbers or block counts ('16b'), got {fractions!r}")
        self.fractions = fs
        self.capacity = capacity
        self.cur = 0
        self.window = window
        self.margin = margin
        self.min_gain = min_gain
        self._req = None
        self._done = 0                       # chain positions of the current request already replayed
        if capacity:
            rate = min(1.0, shadow_blocks / capacity)
            self.thr = int(rate * 0xFFFFFFFF)
            self.scap = max(1, int(rate * capacity))
            self.limits = [max(1, int(v if blocks else v * capacity)) for v, blocks in vals]
            self.shadows = [OrderedDict() for _ in fs]
            self.score = [0.0] * len(fs)
            self._refs = 0

    # ---- the shadows ------------------------------------------------------------------------
    def _replay(self, chain: Sequence[bytes], start: int) -> None:
        thr = self.thr
        samp = [(p, k) for p, k in enumerate(chain[start:], start) if crc32(k) <= thr]
        if not samp:
            return
        scap, score = self.scap, self.score
        for i, od in enumerate(self.shadows):
            m = 0
            n = len(samp)
            while m < n and samp[m][1] in od:
                m += 1
            score[i] += m
            lim = (samp[m][0] + self.limits[i]) if m < n else 0
            mte = od.move_to_end
            for p, k in reversed(samp):       # the request freed tail-first: deepest nearest the head
                if k in od:
                    mte(k)
                elif p < lim:
                    od[k] = None
            while len(od) > scap:
                od.popitem(last=False)
        self._refs += len(samp)
        if self._refs >= self.window * scap:
            self._refs = 0
            for i in range(len(score)):
                score[i] *= 0.5
        best = max(range(len(score)), key=score.__getitem__)
        if score[best] < score[0] * (1.0 + self.min_gain):
            self.cur = 0      # not clearly better than the first candidate (admit all): keep it
        elif score[best] > score[self.cur] * (1.0 + self.margin) + 1.0:
            self.cur = best

    # ---- admission ----------------------------------------------------------------------------
    def admit(self, keys: Sequence[bytes], info: RequestInfo = _NO_INFO) -> list[bool]:
        n = len(keys)
        if not self.capacity or not n:
            return [True] * n
        chain = info.keys
        if info.num_tokens and info.block_tokens:   # full blocks only: all that vLLM hashes
            chain = chain[:info.num_tokens // info.block_tokens]
        if chain:
            rid = request_id(info)
            if rid != self._req:
                self._req, self._done = rid, 0
            if len(chain) > self._done:
                self._replay(chain, self._done)
                self._done = len(chain)
        lim = self.limits[self.cur]
        if n <= lim:
            return [True] * n
        return [True] * lim + [False] * (n - lim)

    @property
    def fraction(self) -> str:
        return self.fractions[self.cur]

