"""Admission policies: whether a block is worth writing to a tier at all."""

from __future__ import annotations

from typing import Sequence

from xxhash import xxh3_64_intdigest

from .base import ADMISSION, AdmissionPolicy, RequestInfo, _NO_INFO


@ADMISSION.register
class AdmitAll(AdmissionPolicy):
    """Admit every block."""

    name = "all"

    def admit(self, keys: Sequence[bytes], info: RequestInfo = _NO_INFO) -> list[bool]:
        return [True] * len(keys)


class _CountMin:
    """A small count-min sketch with periodic halving (aging), over bytes keys.

    `width` counters per row, `depth` rows; after `window` increments every counter is
    halved, so the history forgets at a bounded rate and memory stays fixed.
    """

    __slots__ = ("width", "depth", "rows", "window", "adds", "cap")

    def __init__(self, width: int, depth: int = 4, window: int | None = None, cap: int = 15) -> None:
        self.width = max(16, int(width))
        self.depth = depth
        self.rows = [bytearray(self.width) for _ in range(depth)]
        self.window = window if window is not None else 10 * self.width
        self.adds = 0
        self.cap = cap

    def _idx(self, key: bytes) -> list[int]:
        h = xxh3_64_intdigest(key)  # not hash(): salted per process, so runs would differ
        w = self.width
        out = []
        for i in range(self.depth):
            out.append((h >> (16 * i) ^ (h >> 40) * (i + 1)) % w if i else h % w)
        return out

    def estimate(self, key: bytes) -> int:
        rows = self.rows
        return min(rows[i][j] for i, j in enumerate(self._idx(key)))

    def add(self, key: bytes) -> int:
        """Count one occurrence; returns the estimate before the increment."""
        rows = self.rows
        idx = self._idx(key)
        est = min(rows[i][j] for i, j in enumerate(idx))
        if est < self.cap:
            for i, j in enumerate(idx):  # conservative update
                if rows[i][j] == est:
                    rows[i][j] = est + 1
        self.adds += 1
        if self.adds >= self.window:
            self.adds = 0
            for r in rows:
                for j in range(len(r)):
                    r[j] >>= 1
        return est


@ADMISSION.register
class SecondHit(AdmissionPolicy):
    """Admit a block only from its second sighting on (a frequency filter, e.g. for NVMe wear).

    History is bounded: a count-min sketch of `history` counters per row (default 4 x
    capacity when `capacity` is given, else 65536), halved every 10 x history sightings.
    `threshold` sightings (before this one) are needed; 1 = "second hit".
    """

    name = "second_hit"

    def __init__(self, history: int | None = None, capacity: int | None = None, threshold: int = 1,
                 depth: int = 4, **params) -> None:
        super().__init__(**params)
        if history is None:
            history = 4 * capacity if capacity else 65536
        self.threshold = threshold
        self.sketch = _CountMin(history, depth)

    def admit(self, keys: Sequence[bytes], info: RequestInfo = _NO_INFO) -> list[bool]:
        add, t = self.sketch.add, self.threshold
        return [add(k) >= t for k in keys]


@ADMISSION.register
class ContinuationSample(AdmissionPolicy):
    """Keep whole conversations, not a thin slice of every one.

    Reuse in chained-prefix traffic is a conversation's next turn re-reading the previous
    turn, and it comes back after a gap longer than a small cache's LRU window. Admitting
    every cold request makes all of them leave before their next turn; admitting a fixed
    share `sample` of cold requests (chosen by a hash of the request's deepest new block, so
    the choice is deterministic) makes the admitted ones stay long enough to hit. A request
    that continues a cached prefix deeper than `min_hit` blocks is always admitted, so an
    admitted conversation stays admitted while it is alive. Partial last blocks are never
    admitted (their content changes in the next turn).
    """

    name = "continuation"

    def __init__(self, sample: float = 0.25, min_hit: int = 2, partial: bool = False, **params) -> None:
        super().__init__(**params)
        if not 0.0 <= sample <= 1.0:
            raise ValueError(f"continuation: sample must be in [0, 1], got {sample}")
        self.sample = sample
        self.min_hit = min_hit
        self.partial = partial
        self._thr = int(sample * (1 << 32))

    def admit(self, keys: Sequence[bytes], info: RequestInfo = _NO_INFO) -> list[bool]:
        n = len(keys)
        if n == 0:
            return []
        ok = info.hit_blocks >= self.min_hit
        if not ok:
            import zlib
            ok = zlib.crc32(keys[-1]) < self._thr
        if not ok:
            return [False] * n
        out = [True] * n
        if not self.partial and info.num_tokens and info.block_tokens:
            # keys are the call's missing blocks; the chain's last block is the request's last
            chain = info.keys
            if chain and keys[-1] == chain[-1] and not info.is_full(len(chain) - 1):
                out[-1] = False
        return out
