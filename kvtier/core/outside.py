"""Where blocks live outside the tiers, as the executor (`kvtier.core.executor`) sees it: a
caller's tensors (`Buffers`: the CLI, replay) or vLLM's KV (`kvtier.connector.kv_layout.KVCopier`)."""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import torch

from kvtier.tiers.cpu_pool import copy_blocks


class Outside(Protocol):
    """Where blocks live outside the tiers. `layered`: loads are enqueued on a device and each
    layer's consumer waits on its own event (`load_layered`), else copies run on the caller.
    `direct_reads`: a lower tier may read blocks straight into `direct(block_ids)`.
    `device_staging`: rows in the outside's device memory that a tier reading device memory
    (`NvmeData.device_reads`: GPUDirect Storage) reads into, verifies there, then copies from
    into the blocks (`job` with those rows); None: the outside has none."""

    layered: bool
    direct_reads: bool
    device_staging: Any

    def job(self, host: torch.Tensor, block_ids: Sequence[int], rows: Sequence[int],
            bufs: Sequence[torch.Tensor]) -> Any:
        """The copy between these blocks and these rows of `host` ([rows, block bytes]); `bufs`
        are the same rows as tensors (for layouts that copy per view)."""

    def direct(self, block_ids: Sequence[int]) -> list[torch.Tensor]:
        """Buffers a lower tier reads these blocks into (with `direct_reads`)."""

    def run(self, jobs: Sequence[Any], to_outside: bool) -> None: ...

    def store_async(self, jobs: Sequence[Any]) -> Any: ...

    def load_layered(self, jobs: Sequence[Any]) -> list | None: ...

    def wait_layer(self, event: Any) -> None:
        """The consumer's later work (a device's compute stream) waits for `event`; the host does not."""

    def sync(self, event: Any) -> None: ...

    def done(self, event: Any) -> bool:
        """Whether the copies before `event` completed (the host does not wait)."""


class Buffers:
    """The outside of a caller with a tensor per block id (`blocks[b]`, `block_bytes` each)."""

    layered = False
    direct_reads = True
    device_staging = None

    def __init__(self, blocks: Sequence[torch.Tensor] | dict, block_bytes: int) -> None:
        self.blocks = blocks
        self.block_bytes = block_bytes

    def job(self, host, block_ids, rows, bufs):
        return [(self.blocks[b], buf) for b, buf in zip(block_ids, bufs)]

    def direct(self, block_ids):
        return [self.blocks[b] for b in block_ids]

    def run(self, jobs, to_outside: bool) -> None:
        pairs = [p for j in jobs for p in j]
        if not pairs:
            return
        outs = [_bytes(b) for b, _ in pairs]
        rows = [_bytes(r) for _, r in pairs]
        if to_outside:
            copy_blocks(outs, rows, self.block_bytes)
        else:
            copy_blocks(rows, outs, self.block_bytes)

    def store_async(self, jobs):
        self.run(jobs, to_outside=False)

    def load_layered(self, jobs):
        self.run(jobs, to_outside=True)

    def wait_layer(self, event) -> None:
        pass

    def sync(self, event) -> None:
        pass

    def done(self, event) -> bool:
        return True


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8) if t.dtype != torch.uint8 or t.dim() != 1 else t
