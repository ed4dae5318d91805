"""Tiers: the tier contract, CPU and NVMe slot tiers, the shared tier, the GPU adapter, and the I/O engines."""

from .base import SlotTier, TierFull
from .contract import BlockView, DataPlane, Medium, Tier
from .io_engine import DoneHandle, FutureHandle, IOHandle, IOResult

__all__ = ["BlockView", "DataPlane", "Medium", "SlotTier", "Tier", "TierFull", "DoneHandle", "FutureHandle",
           "IOHandle", "IOResult"]
