"""Staging rows for NVMe loads that have no CPU slot to read through (promotion off or no room).

One page-aligned anonymous mapping (usable directly as an O_DIRECT buffer), grown on demand;
each load of a step gets its own rows, so two loads in one step never share bytes.
"""

from __future__ import annotations

import mmap

import numpy as np
import torch


class Staging:
    def __init__(self, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self._mm: mmap.mmap | None = None
        self._t: torch.Tensor | None = None

    def views(self, n: int) -> list[torch.Tensor]:
        """Rows 0..n-1, one block each (the buffer grows to n rows; its contents are not kept)."""
        bb = self.block_bytes
        if self._t is None or self._t.numel() < n * bb:
            self._mm = mmap.mmap(-1, max(n * bb, mmap.PAGESIZE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self._t = torch.frombuffer(self._mm, dtype=torch.uint8, count=n * bb)
            self._t.zero_()
        return list(self._t[:n * bb].view(n, bb).unbind(0))

    def rows3(self, layers: int, layer_bytes: int) -> np.ndarray:
        """The buffer as [row, layer, layer bytes] (a numpy view, for row copies)."""
        t = self._t
        return t[:t.numel() // self.block_bytes * self.block_bytes].view(-1, layers, layer_bytes).numpy()

    def close(self) -> None:
        self._t = None
        self._mm = None
