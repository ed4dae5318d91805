"""CPU DRAM tier: slot control plane over a CpuPool."""

from __future__ import annotations

from typing import Sequence

import torch

from kvtier.policies.base import EvictionPolicy

from .base import SlotTier
from .cpu_pool import CpuPool
from .io_engine import IOHandle


class CpuTier(SlotTier):
    kind = "cpu"

    def __init__(self, name: str, capacity_blocks: int, block_bytes: int, eviction: EvictionPolicy,
                 pin: str | bool = "auto", with_data: bool = True) -> None:
        super().__init__(name, capacity_blocks, block_bytes, eviction)
        self.pool = CpuPool(capacity_blocks, block_bytes, pin) if with_data else None
        self.data_plane = self.pool

    def write(self, slots: Sequence[int], srcs: Sequence[torch.Tensor]) -> IOHandle:
        return self.pool.write(slots, srcs)

    def read(self, slots: Sequence[int], dsts: Sequence[torch.Tensor]) -> IOHandle:
        return self.pool.read(slots, dsts)

    def view(self, slot: int) -> torch.Tensor:
        """Zero-copy view of a slot (page-aligned: usable directly as an O_DIRECT buffer)."""
        return self.pool.views[slot]

    @property
    def io_engine(self) -> str:
        if self.pool is None:
            return "none (metadata only)"
        eng = "memcpy split over the cores (torch foreach_copy for GPU buffers)"
        return f"{eng}, pinned" if self.pool.pinned else eng

    def stats(self) -> dict:
        d = super().stats()
        d["engine"] = self.io_engine
        d["pinned"] = bool(self.pool and self.pool.pinned)
        return d

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
