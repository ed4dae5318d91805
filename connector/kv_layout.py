"""vLLM's KV layout and the copies between it and contiguous block rows (gather / scatter).

A block below the GPU is one contiguous region of `block_bytes`: layer 0's bytes of that block,
then layer 1's, ..., each layer's block in one canonical order (`canonical_view`: heads, tokens,
content), so what is stored does not depend on vLLM's physical layout (NHD, HND, cross-layer,
kernel-block splits). The CPU attention backend packs K transposed inside a (block, head) slab:
its blocks are stored as they lie and named apart (`layout_name`). `KVLayout` reads vLLM's
per-layer tensors; `KVCopier` moves blocks between them and the rows of a CPU pool (or a
staging buffer), as typed copy jobs: `RowCopy` (runs of consecutive (block, row) pairs: one
strided copy per run, over all layers when vLLM's layers share one allocation), `ViewCopy`
(per-layer canonical views, the general case) and `DeviceJob` (the GPU's device copier).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from kvtier.core.staging import Staging
from kvtier.tiers.cpu_pool import CpuPool, copy_pool, copy_blocks, cuda_available

from .device_copy import CudaStreams, DeviceCopier


@dataclass
class RowCopy:
    """Blocks <-> rows of `rows3` ([row, layer, layer bytes], numpy), as `runs` (see `runs`)."""

    rows3: np.ndarray
    runs: list[tuple[int, int, int, int, int]]


@dataclass
class ViewCopy:
    """dst[i] <- src[i]: per-layer views, block-major (layer li of the k-th block at k*L + li)."""

    dst: list[torch.Tensor]
    src: list[torch.Tensor]


class KVLayout:
    """Every layer's KV tensor as blocks of bytes, and the split of one block region.

    `num_blocks`: the KV-cache manager's blocks (vLLM's `kv_cache_config.num_blocks`). When the
    attention backend rejects the manager's block size, vLLM splits each block into `ratio`
    kernel blocks and the tensors' first dimension is `num_blocks * ratio`: block b is kernel
    blocks [b * ratio, (b + 1) * ratio). A layer whose block is one dense byte range (whatever
    the order of heads and tokens inside it) gets a `[num_blocks, layer_bytes]` byte view; views
    of single blocks are made when a copy needs them, never kept per block.
    """

    def __init__(self, kv_caches: dict[str, torch.Tensor], num_blocks: int | None = None) -> None:
        # Several names may share one region of memory (layers sharing KV; with the hybrid
        # allocator, layers of different groups overlaid on one allocation, maybe viewed with other
        # shapes: a Mamba state and an attention page): copy each region once, through the view
        # whose block spans most of it.
        seen: dict[tuple[int, int], int] = {}
        self.names: list[str] = []
        self.tensors: list[torch.Tensor] = []
        self.layer_of: dict[str, int] = {}  # every layer name -> index of the region it uses
        for name, t in kv_caches.items():
            region = (t.data_ptr(), t.stride(0) * t.element_size())
            i = seen.get(region)
            if i is None:
                seen[region] = i = len(self.tensors)
                self.names.append(name)
                self.tensors.append(t)
            elif t[0].numel() * t.element_size() > self.tensors[i][0].numel() * self.tensors[i].element_size():
                self.names[i], self.tensors[i] = name, t
            self.layer_of[name] = i
        if not self.tensors:
            raise ValueError("kvtier: register_kv_caches got no KV tensors")
        nk = {t.shape[0] for t in self.tensors}
        if len(nk) != 1:
            raise ValueError(f"kvtier: layers disagree on the number of blocks: {sorted(nk)}")
        kernel_blocks = nk.pop()
        num_blocks = kernel_blocks if num_blocks is None else int(num_blocks)
        if num_blocks <= 0 or kernel_blocks % num_blocks:
            raise ValueError(f"kvtier: KV tensors have {kernel_blocks} blocks, not a multiple of the "
                             f"{num_blocks} blocks of vLLM's KV-cache config")
        self.ratio = r = kernel_blocks // num_blocks
        self.num_blocks = num_blocks
        self.device = self.tensors[0].device
        self.layer_bytes = [t[:r].numel() * t.element_size() for t in self.tensors]
        self.offsets = [0]
        for b in self.layer_bytes:
            self.offsets.append(self.offsets[-1] + b)
        self.block_bytes = self.offsets[-1]
        # per layer: [num_blocks, ...] uint8 views of each block in canonical order (`canonical_view`),
        # and the [num_blocks, layer_bytes] view when that order is one dense byte range (`flat`)
        self.canon = [canonical_view(t, num_blocks, r) for t in self.tensors]
        self.flat: list[torch.Tensor | None] = [
            c if c.dim() == 2 and c.stride(1) == 1 and c.stride(0) >= lb else None
            for c, lb in zip(self.canon, self.layer_bytes)]

    def block_views(self, block_id: int) -> list[torch.Tensor]:
        """One uint8 view per layer of block `block_id`, its bytes in canonical order."""
        return [f[block_id] if f is not None else c[block_id] for f, c in zip(self.flat, self.canon)]

    def describe(self) -> dict:
        t = self.tensors[0]
        return {"layers": len(self.tensors), "num_blocks": self.num_blocks, "block_bytes": self.block_bytes,
                "kernel_blocks_per_block": self.ratio, "shape": list(t.shape), "stride": list(t.stride()),
                "dtype": str(t.dtype), "device": str(t.device), "format": layout_name(t.device.type),
                "contiguous_blocks": all(f is not None for f in self.flat)}


def canonical_view(t: torch.Tensor, num_blocks: int, ratio: int = 1) -> torch.Tensor:
    """A `[num_blocks, ...]` uint8 view of `t` whose block b, read in index order, is block b's
    bytes in the canonical order, whatever the physical layout (vLLM's `KVCacheLayout`: NHD, HND,
    the cross-layer BL* layouts, padded pages) and kernel-block split.

    vLLM hands each layer as the logical `[blocks * ratio, heads, tokens, content]` view over its
    physical order (`create_kv_cache_views`); the canonical block is `[heads, tokens, content]`
    contiguous, the block's `ratio` kernel blocks' tokens in order. A view of another rank
    (`[blocks * ratio, ...]`, e.g. a Mamba state) is its logical order, kernel blocks first.
    Adjacent dimensions that are contiguous in memory are merged, so a block that lies in
    canonical order is `[num_blocks, layer_bytes]`."""
    el = t.element_size()
    inner = [(t.shape[d], t.stride(d) * el) for d in range(1, t.dim())] + [(el, 1)]
    kernel = (ratio, t.stride(0) * el)
    dims = [inner[0], kernel] + inner[1:] if t.dim() == 4 else [kernel] + inner
    merged: list[list[int]] = []
    for size, stride in dims:
        if size == 1:
            continue
        if merged and merged[-1][1] == stride * size:
            merged[-1] = [merged[-1][0] * size, stride]
        else:
            merged.append([size, stride])
    merged = merged or [[1, 1]]
    return torch.as_strided(_bytes_storage(t), [num_blocks] + [m[0] for m in merged],
                            [t.stride(0) * el * ratio] + [m[1] for m in merged])


def runs(block_ids: Sequence[int], rows: Sequence[int]) -> list[tuple[int, int, int, int, int]]:
    """(first block, first row, length, block step, row step) of each run where blocks and rows
    each move by one (up or down) from pair to pair."""
    out: list[list[int]] = []
    for b, r in zip(block_ids, rows):
        if out:
            b0, r0, n, db, dr = out[-1]
            if n == 1 and abs(b - b0) == 1 and abs(r - r0) == 1:
                out[-1] = [b0, r0, 2, b - b0, r - r0]
                continue
            if n > 1 and b == b0 + db * n and r == r0 + dr * n:
                out[-1][2] = n + 1
                continue
        out.append([b, r, 1, 1, 1])
    return [tuple(x) for x in out]  # type: ignore[misc]


def _sl(start: int, n: int, step: int) -> slice:
    if step == 1:
        return slice(start, start + n)
    stop = start - n
    return slice(start, stop if stop >= 0 else None, -1)


def _layers_view(lay: KVLayout) -> torch.Tensor | None:
    """[layer, block, layer_bytes] uint8 view of all layers' KV when every layer's blocks are
    contiguous rows of one storage and the layers are equally spaced in it; else None."""
    ts = lay.tensors
    lb = lay.layer_bytes[0]
    if lay.device.type != "cpu" or any(f is None or f.stride(0) != lb for f in lay.flat):
        return None
    st = ts[0].untyped_storage()
    if any(t.untyped_storage().data_ptr() != st.data_ptr() for t in ts):
        return None
    ptrs = [t.data_ptr() for t in ts]
    d = ptrs[1] - ptrs[0] if len(ptrs) > 1 else lay.num_blocks * lb
    if d <= 0 or any(b - a != d for a, b in zip(ptrs, ptrs[1:])):
        return None
    base = _bytes_storage(ts[0])
    if (len(ts) - 1) * d + lay.num_blocks * lb > base.numel():
        return None
    return torch.as_strided(base, (len(ts), lay.num_blocks, lb), (d, lb, 1))


def _copy_run_torch(kv3: torch.Tensor, rows: torch.Tensor, run: tuple, to_outside: bool) -> bool:
    """One run (blocks b0.., rows r0..) of every layer as one torch copy; False when the run goes
    up on one side and down on the other (torch views have no negative strides: numpy takes it)."""
    b0, r0, n, db, dr = run
    if n > 1 and db == dr == -1:    # the same pairs, walked upwards
        b0, r0 = b0 - n + 1, r0 - n + 1
    elif n > 1 and (db != 1 or dr != 1):
        return False
    kv = kv3[:, b0:b0 + n]
    rw = rows[r0:r0 + n].transpose(0, 1)
    if kv.shape[-1] % 8 == 0:  # 8-byte elements: a wider inner loop than bytes
        kv, rw = kv.view(torch.int64), rw.view(torch.int64)
    if to_outside:
        kv.copy_(rw)
    else:
        rw.copy_(kv)
    return True


def _bytes_storage(t: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor over t's whole storage, starting at t's first element."""
    n = t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(
        t.untyped_storage(), t.storage_offset() * t.element_size(), (n,), (1,))


@dataclass
class DeviceJob:
    """Blocks <-> rows of a host tensor ([rows, block_bytes] uint8), by the device copier."""

    host: torch.Tensor
    block_ids: list[int]
    rows: list[int]


Job = RowCopy | ViewCopy | DeviceJob


def _parts(jobs: Sequence[DeviceJob]) -> list[tuple[torch.Tensor, list[int], list[int]]]:
    return [(j.host, j.block_ids, j.rows) for j in jobs]


class KVCopier:
    """Copies between vLLM's KV (`layout`) and the slots of a CPU pool (or any rows buffer).

    On the CPU backend: row copies (`RowCopy`, numpy / one torch copy per run). On a GPU: the
    device copier (`device_copy.DeviceCopier`: a step's jobs batched together, on a side stream
    ordered against the forward). Otherwise per-layer canonical views (`ViewCopy`).
    `streams` forces the device copier (tests drive it on CPU tensors with a fake that runs the
    copies later, as a GPU does: `benchmarks/gpu/probes.DeferredStreams`); `count`: the counters
    the device copier counts into (the worker's).
    """

    def __init__(self, layout: KVLayout, pool: CpuPool, streams=None, count=None) -> None:
        self.layout = lay = layout
        self.pool = pool
        n = pool.num_slots
        L = len(lay.layer_bytes)
        uniform = len(set(lay.layer_bytes)) == 1
        self.pool_rows = pool.buffer.view(n, lay.block_bytes)
        dense = all(f is not None for f in lay.flat)
        self.device: DeviceCopier | None = None
        if streams is None and lay.device.type == "cuda" and cuda_available():  # pragma: no cover
            streams = CudaStreams(lay.device)
        if streams is not None:   # gathers / scatters each layer's canonical view, whatever its layout
            self.device = DeviceCopier(lay.canon, lay.offsets, streams, pin=pool.pinned, count=count)
        # rows in the KV's device memory that GPUDirect Storage reads land in (verified there, then
        # scattered like host rows): with the device copier only
        self.device_staging = Staging(lay.block_bytes, device=lay.device) if self.device is not None else None
        # [slot, layer, layer_bytes] views: a run of consecutive (block, slot) pairs is one
        # strided copy per layer (no per-block Python call)
        self.runs_ok = uniform and lay.device.type == "cpu" and dense and self.device is None
        self.pool3 = self.pool_rows.view(n, L, lay.layer_bytes[0]).numpy() if self.runs_ok else None
        self._flat_np = [f.numpy() for f in lay.flat] if self.runs_ok else []
        # every layer's blocks as one strided [layer, block, bytes] view when the layers sit in one
        # allocation at a fixed distance (vLLM's allocate_kv_cache): a run of blocks is then one
        # torch copy over all layers, run by the OpenMP team that the forward uses
        self.kv3 = _layers_view(lay) if self.runs_ok else None

    def _slot_views(self, slot: int) -> list[torch.Tensor]:
        row, offs = self.pool_rows[slot], self.layout.offsets
        return [row[offs[i]:offs[i + 1]] for i in range(len(offs) - 1)]

    def pool_job(self, block_ids: Sequence[int], slots: Sequence[int]) -> Job:
        """The copy between these GPU blocks and these pool slots (either direction)."""
        if self.device is not None:
            return DeviceJob(self.pool_rows, list(block_ids), list(slots))
        if self.runs_ok:
            return RowCopy(self.pool3, runs(block_ids, slots))
        return ViewCopy(self.gpu_views(block_ids), self.slot_views(slots))

    def rows_job(self, host: torch.Tensor, block_ids: Sequence[int], rows: Sequence[int],
                 bufs: Sequence[torch.Tensor]) -> Job:
        """Blocks <- rows of `host` ([rows, block_bytes] uint8), or from the whole-block buffers
        `bufs` when `host` is None (reads into buffers of their own)."""
        lay = self.layout
        if host is not None and self.device is not None:
            return DeviceJob(host, list(block_ids), list(rows))
        if host is not None and self.runs_ok:
            rows3 = host.view(host.shape[0], len(lay.layer_bytes), lay.layer_bytes[0]).numpy()
            return RowCopy(rows3, runs(block_ids, rows))
        src = []
        for v in bufs:
            src.extend(v[lay.offsets[li]:lay.offsets[li + 1]] for li in range(len(lay.layer_bytes)))
        return ViewCopy(self.gpu_views(block_ids), src)

    # ---- the executor's outside (`kvtier.core.executor.Outside`) ----------------------------
    direct_reads = False   # a lower tier reads into host rows (staging, DRAM slots), never into the KV

    @property
    def layered(self) -> bool:
        """Loads overlap the forward, layer by layer (the device copier)."""
        return self.device is not None

    def job(self, host: torch.Tensor, block_ids: Sequence[int], rows: Sequence[int],
            bufs: Sequence[torch.Tensor]) -> Job:
        return self.rows_job(host, block_ids, rows, bufs)

    def direct(self, block_ids: Sequence[int]) -> list[torch.Tensor]:
        raise RuntimeError("the KV takes no direct reads")

    # ---- a GPU: asynchronous, ordered by events ---------------------------------------------
    def store_async(self, jobs: Sequence[Job]) -> object | None:
        """Enqueue KV -> host copies after the forward; returns the event to poll (`done`) before
        the host bytes are used (or None: the copies ran synchronously)."""
        if self.device is None:
            self.run(jobs, to_outside=False)
            return None
        return self.device.store_parts(_parts(jobs)) if jobs else None

    def load_layered(self, jobs: Sequence[Job]) -> list | None:
        """Enqueue host -> KV copies; returns one event per layer for `wait_layer` (None: the
        copies ran synchronously, on the CPU backend)."""
        if self.device is None:
            self.run(jobs, to_outside=True)
            return None
        return self.device.load_parts(_parts(jobs)) if jobs else None

    def wait_layer(self, event) -> None:
        self.device.streams.compute_wait(event)

    def sync(self, event) -> None:
        if event is not None and self.device is not None:
            self.device.sync(event)

    def done(self, event) -> bool:
        """Whether the copies before `event` completed (the host does not wait)."""
        return event is None or self.device is None or self.device.done(event)

    # ---- the host (CPU backend) and per-view copies -----------------------------------------
    def run(self, jobs: Sequence[Job], to_outside: bool) -> None:
        """Every job now, on this thread (and the cores)."""
        rows = [j for j in jobs if isinstance(j, RowCopy)]
        if rows:
            self.copy_rows(rows, to_outside)
        for j in jobs:
            if isinstance(j, ViewCopy):
                if to_outside:
                    self.copy(j.dst, j.src)
                else:
                    self.copy(j.src, j.dst)
        dj = [j for j in jobs if isinstance(j, DeviceJob)]
        if dj:   # all together, as one step's (`DeviceCopier.load_parts` / `store_parts`)
            dev = self.device
            if to_outside:
                events = dev.load_parts(_parts(dj))
                if events:
                    dev.sync(events[-1])
            else:
                dev.sync(dev.store_parts(_parts(dj)))

    def copy(self, dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
        # shapes differ only for non-contiguous layer blocks: view the byte side accordingly
        d2, s2 = [], []
        for d, s in zip(dst, src):
            if d.dtype != s.dtype or d.shape != s.shape:
                if d.dtype == torch.uint8 and d.dim() == 1:
                    d = d.view(s.dtype).view(s.shape)
                else:
                    s = s.view(d.dtype).view(d.shape)
            d2.append(d)
            s2.append(s)
        if d2:
            copy_blocks(d2, s2, d2[0].numel() * d2[0].element_size())

    def copy_runs(self, li: int, rows3, runs, to_outside: bool) -> None:
        """Layer `li` of runs of blocks <-> layer `li` of rows of `rows3` ([row, layer, bytes],
        numpy): one copy per run, in either direction (numpy takes the negative strides)."""
        flat = self._flat_np[li]
        for b0, r0, n, db, dr in runs:
            kv, rows = flat[_sl(b0, n, db)], rows3[_sl(r0, n, dr), li]
            if to_outside:
                np.copyto(kv, rows)
            else:
                np.copyto(rows, kv)

    def _copy_rows(self, jobs: list, layers: Sequence[int], to_outside: bool) -> None:
        for li in layers:
            for j in jobs:
                self.copy_runs(li, j.rows3, j.runs, to_outside)

    def copy_rows(self, jobs: list, to_outside: bool) -> None:
        """Every layer of `jobs`: one torch copy per run over all layers when the KV layers are one
        strided view (torch's OpenMP team splits it over the cores), else the layers split over
        the cores in plain threads (numpy drops the GIL).

        Why not plain threads first: on the CPU backend this runs right after vLLM's own torch
        ops (input preparation before a load, the forward before a store), whose OpenMP worker
        threads keep spinning for a while (libgomp's GOMP_SPINCOUNT); a second Python thread then
        shares a core with a spinning OpenMP thread and the split copy runs at one core's speed."""
        if self.kv3 is not None:
            rest = []
            for j in jobs:
                rows_t = torch.from_numpy(j.rows3)  # a view: no copy
                left = [r for r in j.runs if not _copy_run_torch(self.kv3, rows_t, r, to_outside)]
                if left:
                    rest.append(RowCopy(j.rows3, left))
            jobs = rest
            if not jobs:
                return
        L = len(self.layout.tensors)
        workers = min(os.cpu_count() or 1, L)
        futs = [copy_pool().submit(self._copy_rows, jobs, range(w, L, workers), to_outside) for w in range(1, workers)]
        self._copy_rows(jobs, range(0, L, workers), to_outside)
        for f in futs:
            f.result()

    def gpu_views(self, block_ids: Sequence[int]) -> list[torch.Tensor]:
        out = []
        bv = self.layout.block_views
        for b in block_ids:
            out.extend(bv(b))
        return out

    def slot_views(self, slots: Sequence[int]) -> list[torch.Tensor]:
        out = []
        for s in slots:
            out.extend(self._slot_views(s))
        return out


CANONICAL_FORMAT = "vllm-kv-blocks/canonical-v1"   # every layer's block as [heads, tokens, content]
CPU_PACKED_FORMAT = "vllm-kv-blocks/cpu-packed-v1"  # the CPU attention backend's slabs, as they lie


def layout_name(device_type: str) -> str:
    """The stored bytes' format, for the fingerprint. On a GPU the logical `[heads, tokens,
    content]` of vLLM's view means the same KV under every layout: blocks are canonical. The CPU
    attention backend's logical view is one packed slab per (block, head) (K transposed, then V):
    its bytes are kept as they lie and named apart, so neither is ever served to the other."""
    return CPU_PACKED_FORMAT if device_type == "cpu" else CANONICAL_FORMAT
