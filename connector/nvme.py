"""The NVMe tier split in two for the connector: control plane (scheduler) and data plane (worker).

vLLM may run the scheduler and the workers in different processes, so the two halves share
nothing but a directory and the per-step metadata:

- `NvmeControl` (scheduler, `kvtier.tiers.nvme_control`): slots, reference counts, eviction
  order and the durable LMDB index. It never opens the data file. A block is committed to the
  index only after the worker reported that its bytes were written and fdatasync'd, with the
  checksum the worker computed (`commit_written`). At open it restores every committed entry,
  so a new scheduler serves what an old one wrote.
- `NvmeData` (worker, `kvtier.tiers.nvme_data`): the data file and its I/O engine; it reads and
  writes the slots the scheduler chose, computes checksums on write and verifies the
  scheduler's expected checksums on read. It never opens LMDB.

The directory layout is `kvtier.tiers.nvme.NvmeTier`'s, so `kvtier inspect` and the offline
tools read a connector's tier directory.
"""

from __future__ import annotations

from kvtier.policies.base import EvictionPolicy
from kvtier.tiers import nvme_control
from kvtier.tiers.nvme_data import NvmeData

__all__ = ["NvmeControl", "NvmeData"]


class NvmeControl(nvme_control.NvmeControl):
    """Scheduler-side NVMe tier: the index is opened and recovered at once (there is no data file)."""

    def __init__(self, name: str, path: str, capacity_blocks: int, block_bytes: int, eviction: EvictionPolicy,
                 fingerprint: dict | None = None, on_mismatch: str = "refuse") -> None:
        super().__init__(name, path, capacity_blocks, block_bytes, eviction, fingerprint, on_mismatch)
        try:
            self._publish_meta()
        except BaseException:
            self.close()
            raise

    def drop(self, slots) -> int:  # type: ignore[override]
        """Forget blocks that failed verification on a worker; returns how many were dropped."""
        n = len(super().drop(slots))
        self.corrupt_blocks += n
        return n
