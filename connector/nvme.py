"""The NVMe tier split in two for the connector: control plane (scheduler) and data plane (worker).

vLLM may run the scheduler and the workers in different processes, so the two halves share
nothing but a directory and the per-step metadata:

- `NvmeControl` (scheduler, `kvtier.tiers.nvme_control`): slots, reference counts, eviction
  order and the durable LMDB index; it holds the directory's writer lock and creates its secret.
  It never opens the data file. A block is committed to the index only after the worker
  reported that its bytes were written and fdatasync'd, with the tag the worker computed
  (`commit_written`). At open it restores every committed entry, so a new scheduler serves
  what an old one wrote. Blocks a worker found bad are reported back and `quarantine`d.
- `NvmeData` (worker, `kvtier.tiers.nvme_data`): the data file and its I/O engine; it reads and
  writes the slots the scheduler chose under their keys, seals each block with a keyed header
  on write and verifies key, tag and payload on read. It never opens LMDB.

The directory layout is `kvtier.tiers.nvme.NvmeTier`'s, so `kvtier inspect` and the offline
tools read a connector's tier directory (read-only, without its lock).
"""

from __future__ import annotations

from kvtier.tiers.nvme_control import NvmeControl
from kvtier.tiers.nvme_data import NvmeData

__all__ = ["NvmeControl", "NvmeData"]
