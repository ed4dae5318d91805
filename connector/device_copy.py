"""Copies between vLLM's KV on a GPU and host rows (the pinned CPU pool, staging), ordered
against the forward.

vLLM runs the forward on its current (compute) stream and calls `wait_for_save` right after it
returns, without synchronizing; a load's blocks are read by attention layer by layer. So:

- a store (KV -> host) runs on a side stream that first waits on the compute stream (the forward
  wrote those blocks), and the host bytes are used only after the copy's event completed;
- a load (host -> KV) runs on the side stream after the compute stream's queued work (kernels of
  an earlier step may still read the blocks being overwritten), records one event per layer, and
  `wait_layer` makes the compute stream wait on that layer's event (no host-side wait).

The copies are batched: blocks are gathered / scattered by index on the device through a device
staging buffer laid out as the host rows are (all layers of a block, layer after layer), so one
host<->device copy moves each run of consecutive rows and one kernel per layer moves the blocks;
no per-block, per-layer views are kept. The stream and event calls go through a `Streams` object,
so the ordering is testable on CPU tensors with a recording fake.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Protocol, Sequence

import torch

STAGING_BYTES = 64 << 20  # device staging per chunk of blocks (at least one block)


class Streams(Protocol):
    def fence(self) -> None:
        """The side stream waits for the work queued so far on the compute stream."""

    def side(self) -> contextlib.AbstractContextManager:
        """Run the enclosed copies on the side stream."""

    def record(self) -> Any:
        """An event marking the side stream's work so far."""

    def compute_wait(self, event: Any) -> None:
        """The compute stream waits for `event` (the host does not)."""

    def sync(self, event: Any) -> None:
        """The host waits for `event`."""

    def run(self, fn: Any, *args: Any) -> Any:
        """Queue `fn(*args)` (device copies) on the stream in effect; a CUDA stream runs them in
        order later, so on CUDA this calls it now (a fake may defer it: ordering tests on CPU)."""


class CudaStreams:
    """`Streams` on a CUDA device: one side stream, events recorded on it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def fence(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def side(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self.stream)

    def record(self) -> Any:
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def compute_wait(self, event: Any) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def sync(self, event: Any) -> None:
        event.synchronize()

    def run(self, fn: Any, *args: Any) -> Any:
        return fn(*args)


def row_runs(rows: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first index in `rows`, first row, length) of each run of consecutive rows."""
    out: list[list[int]] = []
    for i, r in enumerate(rows):
        if out and r == out[-1][1] + out[-1][2]:
            out[-1][2] += 1
        else:
            out.append([i, r, 1])
    return [tuple(x) for x in out]  # type: ignore[misc]


class DeviceCopier:
    """Blocks of the device KV (`flat[l]`: [num_blocks, ...] uint8 per layer, a block's bytes in
    index order: `kv_layout.canonical_view`) <-> rows of a host tensor ([rows, block_bytes] uint8: layer 0's bytes of a block, then layer 1's, ...)."""

    def __init__(self, flat: Sequence[torch.Tensor], offsets: Sequence[int], streams: Streams,
                 staging_bytes: int = STAGING_BYTES) -> None:
        self.flat = list(flat)
        self.offsets = list(offsets)
        self.block_bytes = self.offsets[-1]
        self.streams = streams
        self.device = self.flat[0].device
        self.chunk = max(1, staging_bytes // self.block_bytes)
        self._staging: torch.Tensor | None = None

    def _stage(self, n: int) -> torch.Tensor:
        if self._staging is None:
            self._staging = torch.empty((self.chunk, self.block_bytes), dtype=torch.uint8, device=self.device)
        return self._staging[:n]

    def _chunks(self, block_ids: Sequence[int], rows: Sequence[int]) -> Iterator[tuple[list[int], list[int]]]:
        for i in range(0, len(block_ids), self.chunk):
            yield list(block_ids[i:i + self.chunk]), list(rows[i:i + self.chunk])

    def store(self, host: torch.Tensor, block_ids: Sequence[int], rows: Sequence[int]) -> Any:
        """KV blocks -> host rows, after the forward; returns the event to `sync` before the host
        bytes are used."""
        s = self.streams
        s.fence()
        with self._settled(), s.side():
            for ids, rws in self._chunks(block_ids, rows):
                s.run(self._gather, host, ids, rws)
                if len(block_ids) > self.chunk:  # the staging buffer is reused by the next chunk
                    s.sync(s.record())
        return s.record()

    def load(self, host: torch.Tensor, block_ids: Sequence[int], rows: Sequence[int]) -> list[Any]:
        """Host rows -> KV blocks, after the work queued on the compute stream; returns one event
        per layer (`compute_wait` it before that layer's attention)."""
        s = self.streams
        s.fence()
        events: list[Any] = []
        with self._settled(), s.side():
            chunks = list(self._chunks(block_ids, rows))
            for c, (ids, rws) in enumerate(chunks):
                s.run(self._stage_rows, host, ids, rws)
                idx = torch.tensor(ids, dtype=torch.long).to(self.device, non_blocking=True)
                last = c == len(chunks) - 1
                for li in range(len(self.flat)):
                    s.run(self._scatter, li, idx, len(ids))
                    if last:
                        events.append(s.record())
                if not last:  # the staging buffer is reused by the next chunk
                    s.sync(s.record())
        return events

    @contextlib.contextmanager
    def _settled(self) -> Iterator[None]:
        """A copy that fails part-way (an OOM on the staging buffer or the index temporaries, a
        copy the driver rejects) leaves nothing running: the host waits for what was queued before
        the error goes on, so no late copy writes blocks vLLM recomputes or rows handed out again."""
        try:
            yield
        except BaseException:
            try:
                self.streams.sync(self.streams.record())
            except Exception:  # noqa: BLE001 - the device itself failed: the first error goes on
                pass
            raise

    # the copies themselves, queued on the side stream by `Streams.run`
    def _gather(self, host: torch.Tensor, ids: list[int], rws: list[int]) -> None:
        st = self._stage(len(ids))
        idx = torch.tensor(ids, dtype=torch.long).to(self.device, non_blocking=True)
        for li, f in enumerate(self.flat):
            st[:, self.offsets[li]:self.offsets[li + 1]].copy_(f.index_select(0, idx).flatten(1))
        for i, r0, n in row_runs(rws):
            host[r0:r0 + n].copy_(st[i:i + n], non_blocking=True)

    def _stage_rows(self, host: torch.Tensor, ids: list[int], rws: list[int]) -> None:
        st = self._stage(len(ids))
        for i, r0, n in row_runs(rws):
            st[i:i + n].copy_(host[r0:r0 + n], non_blocking=True)

    def _scatter(self, li: int, idx: torch.Tensor, n: int) -> None:
        f = self.flat[li]
        f.index_copy_(0, idx, self._stage(n)[:, self.offsets[li]:self.offsets[li + 1]].view(-1, *f.shape[1:]))

    def close(self) -> None:
        self._staging = None
