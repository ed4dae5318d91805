"""Copies between vLLM's KV on a GPU and host rows (the pinned CPU pool, staging), ordered
against the forward.

vLLM runs the forward on its current (compute) stream and calls `wait_for_save` right after it
returns, without synchronizing; a load's blocks are read by attention layer by layer. So:

- a store (KV -> host) runs on a side stream that first waits on the compute stream (the forward
  wrote those blocks); nothing waits for the store's event (neither the compute stream nor the
  host): the blocks it reads are protected by not being reused until it completed (a running
  request keeps its blocks, a finished one is held, lazy offload pins them, and a block vLLM hands
  out again while a store still reads it is settled by the worker's `handle_preemptions`:
  connector/worker.py), and the host bytes are used only once the event is seen complete
  (`Streams.query`, polled in later steps);
- a load (host -> KV) runs on the side stream after the compute stream's queued work (kernels of
  an earlier step may still read the blocks being overwritten), layer after layer, records one
  event per layer, and `wait_layer` makes the compute stream wait on that layer's event (no
  host-side wait): layer i's event follows layers 0..i's bytes only.

The copies are batched per step and direction: every request's blocks (`store_parts` /
`load_parts`: all host buffers together, their rows in order) are gathered / scattered by one
index tensor (copied to the device once) through a device staging buffer, so a constant number
of kernels per layer moves the blocks, however many requests; no per-block, per-layer views are
kept. A store stages as the host rows are laid out (all layers of a block, layer after layer):
one device->host copy per run of consecutive rows, or, for a chunk whose rows fall in more runs
than the KV has layers, one copy into a registered bounce ring (`StoreBounce`) that the host
scatters into the rows once the copy completed, before the store is seen complete (`done`,
`sync`: a host memcpy per run, not a launch). A load stages layer-major: the host first
copies each layer's bytes of the rows into a registered ring (`HostRing`: one host copy per layer
and host buffer), then one host->device copy and one scatter per layer and chunk. Consecutive chunks of the staging size reuse
the staging buffer in stream order (no host wait). Every host buffer a copy touches is registered
(pinned): the rows (the CPU pool, staging), the loads' layer-major staging (`HostRing`) and the
block indices (`IndexRing`); a run of rows that crosses the end of one registration is split there,
and a ring piece starts past it, so no copy spans two. The stream and event
calls go through a `Streams` object, so the ordering is testable on CPU tensors with a fake that
runs copies later.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch

from kvtier.common.counters import Metric
from kvtier.common.once import Once
from kvtier.tiers.cpu_pool import copy_blocks, host_buffer, registration_ends

log = logging.getLogger("kvtier.connector")

STAGING_BYTES = 64 << 20  # device staging per chunk of blocks (at least one block)
INDEX_ENTRIES = 1 << 16   # the index ring's int64 entries (512 KiB, pinned once)


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

    def query(self, event: Any) -> bool:
        """Whether `event` completed (the host does not wait)."""

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

    def query(self, event: Any) -> bool:
        return event.query()

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


def split_runs(host: torch.Tensor, runs: Sequence[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """`runs` of `host`'s rows cut where a host registration ends, so no copy spans two."""
    rb = host.stride(0) * host.element_size()
    out = []
    for i, r0, n in runs:
        start = host.data_ptr() + r0 * rb
        done = 0
        for end in registration_ends(start, n * rb):
            k, part = divmod(end - start, rb)
            if part:
                raise RuntimeError(f"row {r0 + k} of a host buffer straddles two registrations")
            out.append((i + done, r0 + done, k - done))
            done = k
        out.append((i + done, r0 + done, n - done))
    return out


def settle_before(streams: Streams, inflight: Any, bound: int) -> None:
    """A ring's pieces in flight (`inflight`: (start, event), oldest first): those starting before
    `bound` overlap what is handed out next and are waited for; the completed ones after them are
    dropped, up to the first still running (only the oldest are looked at: O(1) per piece)."""
    while inflight:
        first, ev = inflight[0]
        if first < bound:
            if not streams.query(ev):
                streams.sync(ev)
        elif not streams.query(ev):
            break
        inflight.popleft()


class IndexRing:
    """The block indices of the gathers and scatters, written into a registered (pinned) host ring
    and copied to the device on the side stream (`Streams.run`). A part of the ring is written again
    only once the copy that read it completed: the copies in flight are kept in ring order, so only
    the oldest are looked at (O(1) per copy, amortized): those a ring behind the new part are
    retired (the host waits only when the ring wrapped onto a copy still queued), done ones are
    dropped."""

    def __init__(self, streams: Streams, device: torch.device, pin: bool | str, entries: int = INDEX_ENTRIES) -> None:
        self.streams = streams
        self.device = device
        self.buf = host_buffer(entries * 8, pin, row_bytes=8, what="index ring")
        self.host = self.buf.tensor.view(torch.int64)
        self.size = self.host.numel()
        self.pos = 0   # entries handed out so far (a part never wraps: the ring's tail is skipped)
        self.inflight: deque[tuple[int, Any]] = deque()   # (first entry, event after its copy), in order
        self.trace: list[tuple[int, int]] | None = None   # host ranges copied (tests)

    def to_device(self, ids: Sequence[int]) -> torch.Tensor:
        """`ids` on the device, after the side stream's work so far (call on the side stream)."""
        n = len(ids)
        if n > self.size:
            raise RuntimeError(f"{n} block indices in one copy; the index ring holds {self.size}")
        lo = self.pos
        if lo % self.size + n > self.size:
            lo += self.size - lo % self.size
        hi = lo + n
        s = self.streams
        settle_before(s, self.inflight, hi - self.size)   # a part a ring before `hi` may share entries
        src = self.host[lo % self.size:lo % self.size + n]
        src.copy_(torch.as_tensor(ids, dtype=torch.int64))
        if self.trace is not None:
            self.trace.append((src.data_ptr(), n * 8))
        dst = torch.empty(n, dtype=torch.int64, device=self.device)
        s.run(_to_device, dst, src)
        self.inflight.append((lo, s.record()))
        self.pos = hi
        return dst

    def close(self) -> None:
        self.inflight.clear()
        self.buf.close()


def _to_device(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src, non_blocking=True)


def _gather_rows(src: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> None:
    """out[k] = src[rows[k]] ([rows, bytes] uint8, rows contiguous), as the widest elements both
    sides align to (a byte-wise gather runs about a hundred times slower than an 8-byte one)."""
    for dt in (torch.int64, torch.int32, torch.int16):
        w = dt.itemsize
        if (src.shape[1] % w == 0 and src.stride(0) % w == 0 and src.data_ptr() % w == 0
                and out.data_ptr() % w == 0):
            src, out = src.view(dt), out.view(dt)
            break
    torch.index_select(src, 0, rows, out=out)


class HostRing:
    """A registered (pinned) host ring of bytes that loads stage their rows in, layer-major (a
    layer's bytes of a chunk's rows contiguous), so one host->device copy moves one layer's bytes.
    A piece is taken (`take`) and, once the copies reading it are queued, marked with an event
    recorded after them (`mark`: the pieces taken since the last mark); a part of the ring is
    written again only once its event completed, as `IndexRing` does (the host waits only when a
    load wraps onto a copy still queued; an unmarked piece gets an event first). A piece never
    crosses the end of a registration."""

    def __init__(self, streams: Streams, nbytes: int, pin: bool | str) -> None:
        self.streams = streams
        self.buf = host_buffer(nbytes, pin, what="load staging")
        self.size = nbytes
        self.pos = 0
        self.pending: int | None = None   # the first position taken since the last mark
        self.inflight: deque[tuple[int, Any]] = deque()   # (first position, event after its copies)

    def take(self, n: int) -> torch.Tensor:
        """`n` bytes of the ring that no queued copy still reads (the host may wait for one)."""
        if n > self.size:
            raise RuntimeError(f"a {n}-byte piece of a load; the staging ring holds {self.size}")
        base = self.buf.tensor.data_ptr()
        lo = self.pos
        while True:
            if lo % self.size + n > self.size:
                lo += self.size - lo % self.size
            ends = registration_ends(base + lo % self.size, n)
            if not ends:
                break
            if ends[0] == base + lo % self.size:
                raise RuntimeError(f"a {n}-byte piece of a load is larger than a registration of the staging ring")
            lo += ends[0] - (base + lo % self.size)
        hi = lo + n
        s = self.streams
        if self.pending is not None and self.pending < hi - self.size:   # wraps onto this load's own
            self.mark(s.record())
        settle_before(s, self.inflight, hi - self.size)
        if self.pending is None:
            self.pending = lo
        self.pos = hi
        return self.buf.tensor[lo % self.size:lo % self.size + n]

    def mark(self, event: Any) -> None:
        """The pieces taken since the last mark are read by copies before `event`."""
        if self.pending is not None:
            self.inflight.append((self.pending, event))
            self.pending = None

    def settle(self) -> None:
        """The host waits until no queued copy reads the ring."""
        if self.inflight:
            self.streams.sync(self.inflight[-1][1])
        self.inflight.clear()

    def close(self) -> None:
        self.inflight.clear()
        self.buf.close()


class StoreBounce:
    """A registered (pinned) host ring of rows that a store's chunk of scattered rows lands in with
    one device->host copy; the host scatters each piece's runs into their rows (`reap`: a host
    memcpy per run) once the piece's event completed. A piece is handed out only over pieces
    already scattered: `take` never waits (None: the ring is still in use). The pieces of a store
    being queued have no event until `mark`; `drop_unmarked` forgets them (their store failed)."""

    def __init__(self, streams: Streams, rows: int, block_bytes: int, pin: bool | str) -> None:
        self.streams = streams
        self.buf = host_buffer(rows * block_bytes, pin, row_bytes=block_bytes, what="store bounce")
        self.rows = self.buf.tensor.view(rows, block_bytes)
        self.size = rows
        self.pos = 0   # rows handed out so far (a piece never wraps: the ring's tail is skipped)
        self.inflight: deque[list] = deque()   # [first row, event or None, [(rows, piece rows)]], in order

    def take(self, n: int) -> tuple[int, torch.Tensor] | None:
        """(position, `n` rows) that no copy or scatter still uses, or None (nothing waits)."""
        if n > self.size:
            return None
        lo = self.pos
        if lo % self.size + n > self.size:
            lo += self.size - lo % self.size
        hi = lo + n
        self.reap()
        if self.inflight and self.inflight[0][0] < hi - self.size:
            return None
        self.pos = hi
        return lo, self.rows[lo % self.size:lo % self.size + n]

    def add(self, lo: int, scatters: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The piece at `lo` goes to these rows ((destination rows, its rows of the piece) each)."""
        self.inflight.append([lo, None, scatters])

    def mark(self, event: Any) -> None:
        """The pieces added since the last mark are copied before `event`."""
        for e in reversed(self.inflight):
            if e[1] is not None:
                break
            e[1] = event

    def drop_unmarked(self) -> None:
        """Forget the pieces of the store being queued (it failed)."""
        while self.inflight and self.inflight[-1][1] is None:
            self.inflight.pop()

    def drop_through(self, event: Any) -> None:
        """Forget the pieces up to the one copied before `event` (its copies failed); none when no
        piece has it (a load's event)."""
        if any(e[1] == event for e in self.inflight):
            while self.inflight.popleft()[1] != event:
                pass

    def reap(self) -> None:
        """Scatter the pieces whose copies completed, oldest first, into their rows; a piece whose
        event reports an error is forgotten (nothing of it reaches the rows) and the error goes on."""
        while self.inflight and self.inflight[0][1] is not None:
            try:
                if not self.streams.query(self.inflight[0][1]):
                    return
            except BaseException:
                self.inflight.popleft()
                raise
            _, _, scatters = self.inflight.popleft()
            nbytes = sum(d.numel() for d, _ in scatters)
            copy_blocks([d for d, _ in scatters], [p for _, p in scatters], nbytes // len(scatters))

    def close(self) -> None:
        self.inflight.clear()
        self.buf.close()


Part = tuple[torch.Tensor, Sequence[int], Sequence[int]]   # (host rows, block ids, their rows)
Run = tuple[torch.Tensor, int, int, int]   # (host, first staging row, first host row, length)
Group = tuple[torch.Tensor, int, torch.Tensor]   # (rows buffer, first staging row, its rows' index)


class DeviceCopier:
    """Blocks of the device KV (`flat[l]`: [num_blocks, ...] uint8 per layer, a block's bytes in
    index order: `kv_layout.canonical_view`) <-> rows of host tensors ([rows, block_bytes] uint8:
    layer 0's bytes of a block, then layer 1's, ...). Per chunk of the staging size, whatever the
    number of parts (requests): a store is two kernels per layer (gather, into staging) and a load
    one (scatter), plus one copy of the indices per call and the host<->device copies: a load's one
    per layer, a store's one per run of consecutive rows, or one through the bounce ring for a
    chunk whose runs outnumber the layers (`direct_runs`). `count`: the counters (the worker's)."""

    def __init__(self, flat: Sequence[torch.Tensor], offsets: Sequence[int], streams: Streams,
                 staging_bytes: int = STAGING_BYTES, pin: bool | str = "auto",
                 count: Callable[[str, float], None] | None = None) -> None:
        self.flat = list(flat)
        self.offsets = list(offsets)
        self.block_bytes = self.offsets[-1]
        self.streams = streams
        self.device = self.flat[0].device
        self._staging: torch.Tensor | None = None
        self.index = IndexRing(streams, self.device, pin)
        self.pin = pin
        self.ring: HostRing | None = None   # loads' layer-major host staging (made at the first load)
        self.bounce: StoreBounce | None = None   # stores' scattered rows (made at the first such store)
        self.direct_runs = len(self.flat)   # a store chunk of more runs goes through the bounce ring
        self.chunk = max(1, min(staging_bytes // self.block_bytes, self.index.size))
        self.count = count
        self.once = Once(log)
        self.trace: list[tuple[int, int]] | None = None   # host ranges copied, rows and indices (tests)

    def traced(self) -> list[tuple[int, int]]:
        """Start recording every host range a copy touches (address, bytes); returns the list."""
        self.trace = self.index.trace = []
        return self.trace

    def _stage(self, n: int) -> torch.Tensor:
        if self._staging is None or self._staging.shape[0] < self.chunk:
            self._staging = torch.empty((self.chunk, self.block_bytes), dtype=torch.uint8, device=self.device)
        return self._staging[:n]

    def _chunks(self, parts: Sequence[Part]) -> list[tuple[torch.Tensor, list[Run]]]:
        """(device indices, host runs (host, first staging row, first host row, length)) per chunk
        of all `parts` together, their blocks in host-row order (so neighbouring rows of different
        parts are one copy); the indices go to the device once when they fit the index ring."""
        hosts: dict[tuple[int, int, int], int] = {}
        tensors: list[torch.Tensor] = []
        entries: list[tuple[int, int, int]] = []   # (host, row, block)
        for host, ids, rows in parts:
            if len(ids) != len(rows):
                raise ValueError(f"{len(ids)} blocks for {len(rows)} rows")
            key = (host.data_ptr(), host.stride(0), host.shape[0])
            h = hosts.setdefault(key, len(tensors))
            if h == len(tensors):
                tensors.append(host)
            entries.extend((h, r, b) for b, r in zip(ids, rows))
        entries.sort()
        ids = [b for _, _, b in entries]
        whole = self.index.to_device(ids) if 0 < len(ids) <= self.index.size else None
        out = []
        for c0 in range(0, len(entries), self.chunk):
            sub = entries[c0:c0 + self.chunk]
            idx = whole[c0:c0 + len(sub)] if whole is not None else self.index.to_device(ids[c0:c0 + len(sub)])
            out.append((idx, self._runs(tensors, sub)))
        return out

    def _runs(self, tensors: list[torch.Tensor], sub: list[tuple[int, int, int]]) -> list[Run]:
        """(host, first staging row, first host row, length) per run of consecutive rows of one
        host in `sub` ((host, row, block), sorted), cut where a registration ends."""
        runs = []
        i = 0
        while i < len(sub):
            j = i
            while j < len(sub) and sub[j][0] == sub[i][0]:
                j += 1
            host = tensors[sub[i][0]]
            for k, r0, n in split_runs(host, row_runs([r for _, r, _ in sub[i:j]])):
                runs.append((host, i + k, r0, n))
            i = j
        return runs

    def _traced(self, runs: list[Run]) -> None:
        if self.trace is not None:
            self.trace.extend((h.data_ptr() + r0 * h.stride(0), n * h.stride(0)) for h, _, r0, n in runs)

    def store(self, host: torch.Tensor, block_ids: Sequence[int], rows: Sequence[int]) -> Any:
        """`store_parts` of one part."""
        return self.store_parts([(host, block_ids, rows)])

    def load(self, host: torch.Tensor, block_ids: Sequence[int], rows: Sequence[int]) -> list[Any]:
        """`load_parts` of one part."""
        return self.load_parts([(host, block_ids, rows)])

    def store_parts(self, parts: Sequence[Part]) -> Any:
        """KV blocks -> host rows, after the forward, all parts together; returns the event to poll
        (`done`, or `sync`: not the streams' own, which skip the bounce ring's scatter) before the
        host bytes are used. Nothing waits for it: the caller keeps the blocks from being reused
        until it completed (the module's docstring)."""
        s = self.streams
        s.fence()
        with self._settled(), s.side():
            chunks = self._chunks(parts)
            scattered = [len(runs) > self.direct_runs and all(self.on_host(h) for h, _, _, _ in runs)
                         for _, runs in chunks]
            if any(scattered):
                self._bounce_for(sum(idx.numel() for (idx, _), b in zip(chunks, scattered) if b))
            for (idx, runs), b in zip(chunks, scattered):
                got = self.bounce.take(idx.numel()) if b else None
                if b and got is None:
                    self._bounce_full(idx.numel())
                if got is None:
                    self._traced(runs)
                    s.run(self._gather, idx, runs)
                    continue
                lo, piece = got
                pieces = split_runs(self.bounce.rows, [(0, lo % self.bounce.size, idx.numel())])
                if self.trace is not None:
                    self.trace.extend((piece[i].data_ptr(), n * self.block_bytes) for i, _, n in pieces)
                s.run(self._gather_into, idx, piece, pieces)
                self.bounce.add(lo, [(h[r0:r0 + n], piece[i:i + n]) for h, i, r0, n in runs])
            ev = s.record()
            if self.bounce is not None:
                self.bounce.mark(ev)
            return ev

    def done(self, event: Any) -> bool:
        """Whether the copies before `event` completed, their rows scattered (the host does not wait
        for the device; it scatters the bounce ring's completed pieces); an error forgets the
        pieces up to `event` (their store is not stored)."""
        return self._then_scatter(self.streams.query, event)

    def sync(self, event: Any) -> None:
        """The host waits for `event`, then scatters the bounce ring's completed pieces; an error
        forgets the pieces up to `event` (their store is not stored)."""
        self._then_scatter(self.streams.sync, event)

    def _then_scatter(self, ask: Any, event: Any) -> Any:
        try:
            out = ask(event)
        except BaseException:
            if self.bounce is not None:
                self.bounce.drop_through(event)
            raise
        if self.bounce is not None:
            self.bounce.reap()
        return out

    def _bounce_for(self, rows: int) -> None:
        """A bounce ring of `rows` (up to two chunks of the staging size); a smaller one is replaced
        once nothing in it waits for its scatter (else it serves as it is)."""
        want = min(2 * self.chunk, max(-(-(1 << 20) // self.block_bytes), 1 << (rows - 1).bit_length()))
        if self.bounce is not None and self.bounce.size >= want:
            return
        if self.bounce is not None:
            self.bounce.reap()
            if self.bounce.inflight:
                return
            self.bounce.close()
        self.bounce = StoreBounce(self.streams, want, self.block_bytes, self.pin)

    def _bounce_full(self, n: int) -> None:
        if self.count is not None:
            self.count(Metric.STORE_BOUNCE_FULL.key, 1)
        self.once(("bounce_full",), logging.WARNING, "kvtier: a store of %d scattered rows found the store "
                  "bounce ring (%d rows) still in use: copied run by run (more copies, no wait)", n,
                  self.bounce.size)

    def load_parts(self, parts: Sequence[Part]) -> list[Any]:
        """Host rows -> KV blocks, all parts together, after the work queued on the compute stream;
        returns one event per layer (`compute_wait` it before that layer's attention). Layer-major:
        each layer's bytes of every chunk are staged on the host in a ring piece of their own (one
        host copy per layer and host buffer), then one host->device copy and one scatter per layer
        and chunk; layer i's event follows layers 0..i's bytes only, not the whole load's. Rows
        already in device memory (GPUDirect Storage's staging) are gathered there, per layer."""
        s = self.streams
        s.fence()
        events: list[Any] = []
        with self._settled(), s.side():
            chunks = self._load_chunks(parts)
            self._ring_for(sum(idx.numel() for idx, _, _ in chunks) * self.block_bytes)
            for li in range(len(self.flat)):
                lo, hi = self.offsets[li], self.offsets[li + 1]
                for idx, groups, on_device in chunks:
                    piece = self._host_piece(idx.numel() * (hi - lo)) if groups else None
                    for host, i, rows in groups:
                        _gather_rows(host[:, lo:hi], rows, piece.view(-1, hi - lo)[i:i + rows.numel()])
                    s.run(self._load_layer, li, idx, piece, on_device)
                events.append(s.record())
                self.ring.mark(events[-1])
        return events

    def _load_chunks(self, parts: Sequence[Part]) -> list[tuple[torch.Tensor, list[Group], list[Group]]]:
        """(device indices, groups of host rows, groups of device rows) per chunk of `parts`, as
        `_chunks` orders them; a group: (rows buffer, first staging row, its rows: an index on the
        buffer's side, a device one copied through the index ring)."""
        out = []
        for idx, runs in self._chunks(parts):
            self._traced(runs)
            groups: list[tuple[torch.Tensor, int, list[int]]] = []
            for host, i, r0, n in runs:
                if groups and groups[-1][0] is host and groups[-1][1] + len(groups[-1][2]) == i:
                    groups[-1][2].extend(range(r0, r0 + n))
                else:
                    groups.append((host, i, list(range(r0, r0 + n))))
            on_host = [(h, i, torch.tensor(r, dtype=torch.int64)) for h, i, r in groups if self.on_host(h)]
            on_device = [(h, i, self.index.to_device(r)) for h, i, r in groups if not self.on_host(h)]
            out.append((idx, on_host, on_device))
        return out

    def on_host(self, rows: torch.Tensor) -> bool:
        """Whether a rows buffer is host memory (staged through the ring) or the device's own."""
        return rows.device.type == "cpu"

    def _ring_for(self, nbytes: int) -> None:
        """A staging ring that holds a load of `nbytes` (up to two chunks of the staging size:
        larger loads wrap); a smaller one is replaced once its copies completed."""
        want = min(2 * self.chunk * self.block_bytes, max(1 << 20, 1 << (nbytes - 1).bit_length()))
        if self.ring is not None and self.ring.size >= want:
            return
        if self.ring is not None:
            self.ring.settle()
            self.ring.close()
        self.ring = HostRing(self.streams, want, self.pin)

    def _host_piece(self, n: int) -> torch.Tensor:
        piece = self.ring.take(n)
        if self.trace is not None:
            self.trace.append((piece.data_ptr(), n))
        return piece

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
            if self.bounce is not None:   # a failed store's pieces never reach its rows
                self.bounce.drop_unmarked()
            raise

    # the copies themselves, queued on the side stream by `Streams.run`
    def _staged(self, idx: torch.Tensor) -> torch.Tensor:
        """The blocks `idx` gathered into staging rows (two kernels per layer)."""
        st = self._stage(idx.numel())
        for li, f in enumerate(self.flat):
            st[:, self.offsets[li]:self.offsets[li + 1]].copy_(f.index_select(0, idx).flatten(1))
        return st

    def _gather(self, idx: torch.Tensor, runs: list[Run]) -> None:
        st = self._staged(idx)
        for host, i, r0, n in runs:
            host[r0:r0 + n].copy_(st[i:i + n], non_blocking=True)

    def _gather_into(self, idx: torch.Tensor, piece: torch.Tensor, pieces: list[tuple[int, int, int]]) -> None:
        """The blocks `idx` into the bounce ring's `piece`: one device->host copy (one per
        registration the piece lies in)."""
        st = self._staged(idx)
        for i, _, n in pieces:
            piece[i:i + n].copy_(st[i:i + n], non_blocking=True)

    def _load_layer(self, li: int, idx: torch.Tensor, piece: torch.Tensor | None, on_device: list[Group]) -> None:
        f = self.flat[li]
        lo, hi = self.offsets[li], self.offsets[li + 1]
        st = self._stage(idx.numel()).view(-1)[:idx.numel() * (hi - lo)]
        if piece is not None:
            st.copy_(piece, non_blocking=True)
        for rows, i, at in on_device:
            _gather_rows(rows[:, lo:hi], at, st.view(-1, hi - lo)[i:i + at.numel()])
        f.index_copy_(0, idx, st.view(-1, *f.shape[1:]))

    def close(self) -> None:
        self._staging = None
        self.index.close()
        if self.ring is not None:
            self.ring.close()
        if self.bounce is not None:
            self.bounce.close()
