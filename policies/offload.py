"""Offload policies: which GPU blocks get copied down to the next tier, and when.

Configuration holders; the connector / engine applies them.
"""

from __future__ import annotations

from .base import OFFLOAD, OffloadPolicy


@OFFLOAD.register
class LazyOffload(OffloadPolicy):
    """Copy a GPU block down only when it is about to be reused by vLLM.

    Each scheduler step the engine walks the GPU free-queue cursor from its LRU head and
    copies down at most `max_blocks_per_step` hashed, not-yet-offloaded blocks (the ones
    vLLM would reuse first). Spares bandwidth: blocks that die on the GPU before reuse are
    never written. `max_blocks_per_step` <= 0 means unbounded.
    """

    name = "lazy"
    eager = False

    def __init__(self, max_blocks_per_step: int = 64, **params) -> None:
        super().__init__(**params)
        if isinstance(max_blocks_per_step, bool) or not isinstance(max_blocks_per_step, int):
            raise ValueError(f"lazy offload: max_blocks_per_step must be an int, got {max_blocks_per_step!r}")
        self.max_blocks_per_step = max_blocks_per_step

    def budget(self) -> int | None:
        """Blocks to offload this step (None = unbounded)."""
        return self.max_blocks_per_step if self.max_blocks_per_step > 0 else None


@OFFLOAD.register
class EagerOffload(OffloadPolicy):
    """Copy every full, hashed block of a request down when the request finishes (or as
    its blocks fill): nothing is lost when the GPU reuses a block, at the cost of writes."""

    name = "eager"
    eager = True

    def budget(self) -> int | None:
        return None
