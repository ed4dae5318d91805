"""Admission policies: whether a block is worth writing to a tier at all."""

from __future__ import annotations

from typing import Sequence

from xxhash import xxh3_64_intdigest

from .base import ADMISSION, AdmissionPolicy, RequestInfo, NO_INFO


@ADMISSION.register
class AdmitAll(AdmissionPolicy):
    """Admit every block."""

    name = "all"

    def admit(self, keys: Sequence[bytes], info: RequestInfo = NO_INFO) -> list[bool]:
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

    def admit(self, keys: Sequence[bytes], info: RequestInfo = NO_INFO) -> list[bool]:
        add, t = self.sketch.add, self.threshold
        return [add(k) >= t for k in keys]
