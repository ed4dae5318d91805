"""Tiers: the Tier protocol, CPU and NVMe slot tiers, the GPU adapter, and the I/O engines."""

from .base import BlockView, SlotTier, TierFull, TierProtocol
from .handles import DoneHandle, FutureHandle, IOHandle, IOResult

__all__ = ["BlockView", "SlotTier", "TierFull", "TierProtocol", "DoneHandle", "FutureHandle", "IOHandle", "IOResult"]
