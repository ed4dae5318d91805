"""Staging rows for NVMe loads that have no CPU slot to read through (promotion off or no room).

One page-aligned, pre-touched host buffer (`cpu_pool.host_buffer`: usable directly as an
O_DIRECT buffer; pinned under CUDA like the CPU pool, pageable with one warning if that fails),
grown on demand; each load of a step gets its own rows, so two loads in one step never share bytes.
With `device`, the rows are device memory instead (an outside's `device_staging`: an engine that
reads device memory, GPUDirect Storage, reads into them, and they are verified there).
"""

from __future__ import annotations

import torch

from kvtier.tiers.cpu_pool import HostBuffer, host_buffer


class Staging:
    def __init__(self, block_bytes: int, pin: str | bool = "auto", device: torch.device | None = None) -> None:
        self.block_bytes = block_bytes
        self.pin = pin
        self.device = device
        self._buf: HostBuffer | None = None
        self._t: torch.Tensor | None = None

    @property
    def pinned(self) -> bool:
        return self._buf is not None and self._buf.pinned

    def views(self, n: int) -> list[torch.Tensor]:
        """Rows 0..n-1, one block each (the buffer grows to n rows; its contents are not kept)."""
        bb = self.block_bytes
        if self._t is None or self._t.numel() < n * bb:
            # the old rows are unregistered now: no copy from them may still be in flight (the
            # worker calls this only after the last step's loads finished)
            self.close()
            if self.device is not None:
                self._t = torch.empty(n * bb, dtype=torch.uint8, device=self.device)
            else:
                self._buf = host_buffer(n * bb, self.pin, row_bytes=bb, what="staging buffer")
                self._t = self._buf.tensor
        return list(self._t[:n * bb].view(n, bb).unbind(0))

    def rows(self) -> torch.Tensor:
        """The buffer as [row, block_bytes] (the rows `views` handed out, and any beyond)."""
        t = self._t
        return t[:t.numel() // self.block_bytes * self.block_bytes].view(-1, self.block_bytes)

    def close(self) -> None:
        if self._buf is not None:
            self._buf.close()
        self._buf = None
        self._t = None
