"""Worker side of the connector: the data plane.

`register_kv_caches` reads vLLM's per-layer KV tensors; a block below the GPU is one
contiguous region of `block_bytes`: layer 0's bytes of that block, then layer 1's, ... (each
layer's block copied as raw bytes, so the attention backend's inner layout never matters).
Loads run in `start_load_kv` (NVMe reads and checksums there; with a GPU the copies into vLLM's
KV then run layer by layer on a loader thread and `wait_for_layer_load` waits for its layer; on
the CPU backend they run at once, on the calling thread), stores in `wait_for_save`
(after the forward that wrote them). On the CPU backend a run of consecutive (block, slot)
pairs is one strided torch copy over all layers (numpy per layer where the layers are not one
allocation or a run goes up on one side and down on the other). With CUDA, copies run on a side stream
into pinned host memory.

NVMe write-through is write-behind: `wait_for_save` copies the step's blocks into CPU slots and
queues their NVMe writes; a flusher thread writes them, fdatasyncs and hands the per-slot
checksums to the report of a later step (at most `nvme_write_lag_steps` later; 0 = this step).
The scheduler keeps the CPU source pinned and the NVMe slot invisible until that report.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any, Sequence

import numpy as np
import torch

from kvtier.tiers.cpu_pool import CpuPool, _copier, copy_blocks, cuda_available

from .metadata import Counting, KVTierMetadata, KVTierWorkerMeta

log = logging.getLogger("kvtier.connector")

SHUTDOWN_FLUSH_TIMEOUT_S = 30.0  # close(): longest wait for pending NVMe write-back


class KVLayout:
    """Per-block byte views of every layer's KV tensor, and the split of one block region."""

    def __init__(self, kv_caches: dict[str, torch.Tensor]) -> None:
        # vLLM may hand several names for one tensor (shared KV layers): copy each buffer once.
        seen: dict[tuple[int, tuple, tuple], int] = {}
        self.names: list[str] = []
        self.tensors: list[torch.Tensor] = []
        self.layer_of: dict[str, int] = {}  # every layer name -> index of the buffer it uses
        for name, t in kv_caches.items():
            sig = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
            if sig not in seen:
                seen[sig] = len(self.tensors)
                self.names.append(name)
                self.tensors.append(t)
            self.layer_of[name] = seen[sig]
        if not self.tensors:
            raise ValueError("kvtier: register_kv_caches got no KV tensors")
        nb = {t.shape[0] for t in self.tensors}
        if len(nb) != 1:
            raise ValueError(f"kvtier: layers disagree on the number of blocks: {sorted(nb)}")
        self.num_blocks = nb.pop()
        self.device = self.tensors[0].device
        self.layer_bytes = [t[0].numel() * t.element_size() for t in self.tensors]
        self.offsets = [0]
        for b in self.layer_bytes:
            self.offsets.append(self.offsets[-1] + b)
        self.block_bytes = self.offsets[-1]
        # per layer: a [num_blocks, layer_bytes] uint8 view when a block is contiguous, else None
        self._flat: list[torch.Tensor | None] = []
        for li, t in enumerate(self.tensors):
            stride_b = t.stride(0) * t.element_size()
            if t[0].is_contiguous() and stride_b >= self.layer_bytes[li]:
                self._flat.append(torch.as_strided(_bytes_storage(t), (self.num_blocks, self.layer_bytes[li]),
                                                   (stride_b, 1)))
            else:
                self._flat.append(None)
        self._views: list[tuple[torch.Tensor, ...] | None] = [f.unbind(0) if f is not None else None
                                                              for f in self._flat]

    def block_views(self, block_id: int) -> list[torch.Tensor]:
        """One view per layer of GPU block `block_id` (uint8 when contiguous)."""
        out = []
        for li, v in enumerate(self._views):
            out.append(v[block_id] if v is not None else self.tensors[li][block_id])
        return out

    def describe(self) -> dict:
        t = self.tensors[0]
        return {"layers": len(self.tensors), "num_blocks": self.num_blocks, "block_bytes": self.block_bytes,
                "shape": list(t.shape), "stride": list(t.stride()), "dtype": str(t.dtype), "device": str(t.device),
                "contiguous_blocks": all(f is not None for f in self._flat)}


def _runs(block_ids: Sequence[int], rows: Sequence[int]) -> list[tuple[int, int, int, int, int]]:
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


def _layers_view(lay: "KVLayout") -> torch.Tensor | None:
    """[layer, block, layer_bytes] uint8 view of all layers' KV when every layer's blocks are
    contiguous rows of one storage and the layers are equally spaced in it; else None."""
    ts = lay.tensors
    lb = lay.layer_bytes[0]
    if lay.device.type != "cpu" or any(f is None or f.stride(0) != lb for f in lay._flat):
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


def _copy_run_torch(kv3: torch.Tensor, rows: torch.Tensor, run: tuple, to_kv: bool) -> bool:
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
    if to_kv:
        kv.copy_(rw)
    else:
        rw.copy_(kv)
    return True


def _bytes_storage(t: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor over t's whole storage, starting at t's first element."""
    n = t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(
        t.untyped_storage(), t.storage_offset() * t.element_size(), (n,), (1,))


class KVTierWorker(Counting):
    def __init__(self, cpu_blocks_fn, pin: str | bool = "auto", expected_block_bytes: int | None = None,
                 nvme_io: str = "auto", nvme_io_threads: int = 4, nvme_direct: bool | str = "auto",
                 nvme_write_lag_steps: int = 4, rank: int = 0) -> None:
        self._cpu_blocks_fn = cpu_blocks_fn
        self._pin = pin
        self._expected = expected_block_bytes
        self.layout: KVLayout | None = None
        self.pools: list[CpuPool] = []
        self._slot_layer: list[tuple[torch.Tensor, ...] | None] = []
        self._meta: KVTierMetadata | None = None
        self.rank = rank                      # this worker's shard: NVMe file data.<rank>, its own checksums
        self._result = KVTierWorkerMeta(rank=rank)
        self._load_errors: set[int] = set()
        self._init_counters()
        self._stream = None
        self.tier_names = ["cpu", "nvme"]
        self.nvme = None                      # NvmeData, opened on the first step that names its dir
        self._nvme_args = (nvme_io, nvme_io_threads, nvme_direct)
        self._staging = None                  # page-aligned buffer for NVMe loads without CPU slots
        self.nvme_load_chunk_bytes = 8 << 20  # CPU backend: copy NVMe loads into the KV per chunk read
        self.corrupt_blocks = 0
        # write-behind: batches of NVMe writes in flight, oldest first: (step, future of results)
        self._write_lag = max(0, int(nvme_write_lag_steps))
        self._writes: list[tuple[int, Future]] = []
        self._flusher: ThreadPoolExecutor | None = None
        self._step = 0
        # layer-pipelined loads: copies run layer by layer on a loader thread while the forward
        # runs; wait_layer(name) blocks until that layer's blocks are in place
        self._loader: ThreadPoolExecutor | None = None
        self._load_job: Future | None = None
        self._layer_events: list[threading.Event] | None = None
        self._load_done: list[tuple[Any, str, list[bool]]] = []
        self._sync_s = self._copy_s = 0.0
        # test hook: corrupt / fail loads on purpose
        self.fail_loads = False

    # ---- setup -------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.layout = lay = KVLayout(kv_caches)
        if self._expected is not None and self._expected != lay.block_bytes:
            raise ValueError(f"kvtier: block is {lay.block_bytes} B on the worker but the scheduler "
                             f"sized its tiers for {self._expected} B")
        n = self._cpu_blocks_fn(lay.block_bytes)
        pool = CpuPool(n, lay.block_bytes, self._pin)
        self.pools = [pool]
        uniform = len(set(lay.layer_bytes)) == 1
        if uniform:
            L = len(lay.layer_bytes)
            self._slot_layer = [pool.buffer.view(n * L, lay.layer_bytes[0]).unbind(0)]
        else:
            self._slot_layer = [None]
        # [slot, layer, layer_bytes] views: a run of consecutive (block, slot) pairs is one
        # strided copy per layer (no per-block Python call)
        self._runs_ok = uniform and lay.device.type == "cpu" and all(f is not None for f in lay._flat)
        self._pool3 = [pool.buffer.view(n, len(lay.layer_bytes), lay.layer_bytes[0]).numpy()] if self._runs_ok else [None]
        self._flat_np = [f.numpy() for f in lay._flat] if self._runs_ok else []
        # every layer's blocks as one strided [layer, block, bytes] view when the layers sit in one
        # allocation at a fixed distance (vLLM's allocate_kv_cache): a run of blocks is then one
        # torch copy over all layers, run by the OpenMP team that the forward uses
        self._kv3 = _layers_view(lay) if self._runs_ok else None
        if lay.device.type == "cuda" and cuda_available():  # pragma: no cover - GPU only
            self._stream = torch.cuda.Stream(device=lay.device)
        log.info("kvtier worker: %s; cpu pool %d slots", lay.describe(), n)

    def _slot_views(self, tier: int, slot: int) -> list[torch.Tensor]:
        lay = self.layout
        cached = self._slot_layer[tier]
        L = len(lay.layer_bytes)
        if cached is not None:
            return list(cached[slot * L:(slot + 1) * L])
        v = self.pools[tier].views[slot]
        return [v[lay.offsets[i]:lay.offsets[i + 1]] for i in range(L)]

    # ---- copies ------------------------------------------------------------------------
    def _copy(self, dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
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
        if self._stream is not None:  # pragma: no cover - GPU only
            with torch.cuda.stream(self._stream):
                torch._foreach_copy_(d2, s2, non_blocking=True)
            self._stream.synchronize()
        elif d2:
            copy_blocks(d2, s2, d2[0].numel() * d2[0].element_size())

    def _copy_runs(self, li: int, rows3, runs, to_kv: bool) -> None:
        """Layer `li` of runs of blocks <-> layer `li` of rows of `rows3` ([row, layer, bytes],
        numpy): one copy per run, in either direction (numpy takes the negative strides)."""
        flat = self._flat_np[li]
        for b0, r0, n, db, dr in runs:
            kv, rows = flat[_sl(b0, n, db)], rows3[_sl(r0, n, dr), li]
            if to_kv:
                np.copyto(kv, rows)
            else:
                np.copyto(rows, kv)

    def _copy_rows(self, jobs: list, layers: Sequence[int], to_kv: bool) -> None:
        for li in layers:
            for _, rows3, runs in jobs:
                self._copy_runs(li, rows3, runs, to_kv)

    def _copy_rows_parallel(self, jobs: list, to_kv: bool) -> None:
        """Every layer of `jobs`: one torch copy per run over all layers when the KV layers are one
        strided view (torch's OpenMP team splits it over the cores), else the layers split over
        the cores in plain threads (numpy drops the GIL).

        Why not plain threads first: on the CPU backend this runs right after vLLM's own torch
        ops (input preparation before a load, the forward before a store), whose OpenMP worker
        threads keep spinning for a while (libgomp's GOMP_SPINCOUNT); a second Python thread then
        shares a core with a spinning OpenMP thread and the split copy runs at one core's speed."""
        if self._kv3 is not None:
            rest = []
            for kind, rows3, runs in jobs:
                rows_t = torch.from_numpy(rows3)  # a view: no copy
                left = [r for r in runs if not _copy_run_torch(self._kv3, rows_t, r, to_kv)]
                if left:
                    rest.append((kind, rows3, left))
            jobs = rest
            if not jobs:
                return
        L = len(self.layout.tensors)
        workers = min(os.cpu_count() or 1, L)
        futs = [_copier().submit(self._copy_rows, jobs, range(w, L, workers), to_kv) for w in range(1, workers)]
        self._copy_rows(jobs, range(0, L, workers), to_kv)
        for f in futs:
            f.result()

    def _gpu_views(self, block_ids: Sequence[int]) -> list[torch.Tensor]:
        out = []
        bv = self.layout.block_views
        for b in block_ids:
            out.extend(bv(b))
        return out

    def _tier_views(self, tier: int, slots: Sequence[int]) -> list[torch.Tensor]:
        out = []
        for s in slots:
            out.extend(self._slot_views(tier, s))
        return out

    # ---- per step ----------------------------------------------------------------------
    def _tier_name(self, tier: int) -> str:
        return self.tier_names[tier] if tier < len(self.tier_names) else str(tier)

    def bind(self, meta: Any) -> None:
        self._meta = meta if isinstance(meta, KVTierMetadata) else None

    def _open_nvme(self, meta: KVTierMetadata) -> None:
        if meta.nvme_dir is None or self.layout is None:
            return
        if self.nvme is not None and self.nvme.dir == meta.nvme_dir:
            return
        from .nvme import NvmeData
        if self.nvme is not None:
            self._reap_writes(wait=True)
            self.nvme.close()
        io, threads, direct = self._nvme_args
        self.nvme = NvmeData(meta.nvme_dir, meta.nvme_capacity, self.layout.block_bytes, io, threads, direct,
                             rank=self.rank)

    def _staging_rows(self) -> np.ndarray:
        """The staging buffer as [row, layer, layer bytes] (numpy view)."""
        lay = self.layout
        t = self._staging[1]
        return t[:t.numel() // lay.block_bytes * lay.block_bytes].view(
            -1, len(lay.layer_bytes), lay.layer_bytes[0]).numpy()

    def _staging_views(self, n: int) -> list[torch.Tensor]:
        """Rows 0..n-1 of the staging buffer (grown to n rows; its contents are not kept)."""
        bb = self.layout.block_bytes
        if self._staging is None or self._staging[1].numel() < n * bb:
            import mmap
            mm = mmap.mmap(-1, max(n * bb, mmap.PAGESIZE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            t = torch.frombuffer(mm, dtype=torch.uint8, count=n * bb)
            t.zero_()
            self._staging = (mm, t)
        return list(self._staging[1][:n * bb].view(n, bb).unbind(0))

    def _load_nvme(self, op, jobs: list, stage: list[torch.Tensor], row0: int, copy_now: bool) -> list[bool]:
        """NVMe slots -> (CPU slots `op.via`, or staging rows row0..), checksums verified; the copies
        into the KV go to `jobs`, or with `copy_now` run chunk by chunk as each chunk's reads land
        (the next chunks are still reading meanwhile)."""
        if self.nvme is None:
            raise RuntimeError("no NVMe data plane on this worker (no nvme_dir in the metadata)")
        n = len(op.slots)
        if op.checksums is None or len(op.checksums) != n:
            raise RuntimeError("NVMe load without expected checksums")
        bufs = [self.pools[0].views[s] for s in op.via] if op.via else stage[row0:row0 + n]
        step = max(1, self.nvme_load_chunk_bytes // self.layout.block_bytes) if copy_now else n
        reads = []  # all chunks in flight at once: the engine's pool keeps the disk busy
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            bad = [False] * (hi - lo)
            reads.append((lo, bad, self.nvme.read(op.slots[lo:hi], bufs[lo:hi], op.checksums[lo:hi], bad)))
        # the rows the blocks are copied from: CPU slots, or this op's staging rows
        src3, rows = None, op.via or range(row0, row0 + n)
        if self._runs_ok:
            src3 = self._pool3[0] if op.via else self._staging_rows()
        oks: list[bool] = []
        corrupt: list[int] = []
        errors: list[str] = []
        for lo, bad, h in reads:
            r = h.wait()
            oks.extend(r.ok)
            errors.extend(r.errors)
            corrupt.extend(op.slots[lo + i] for i, b in enumerate(bad) if b)
            good = [lo + i for i, ok in enumerate(r.ok) if ok]
            if not good:
                continue
            blocks = [op.block_ids[i] for i in good]
            if src3 is not None:
                job = ("rows", src3, _runs(blocks, [rows[i] for i in good]))
            else:
                L = len(self.layout.layer_bytes)
                src = []
                for i in good:
                    v = bufs[i]
                    src.extend(v[self.layout.offsets[li]:self.layout.offsets[li + 1]] for li in range(L))
                job = ("views", self._gpu_views(blocks), src)
            if copy_now:
                self._copy_jobs_now([job])
            else:
                jobs.append(job)
        if corrupt:
            self.corrupt_blocks += len(corrupt)
            self._count("corrupt_blocks.nvme", len(corrupt))
            self._result.corrupt.setdefault(op.tier, []).extend(corrupt)
            log.error("kvtier: %d NVMe blocks of %s failed their checksum; reported for recompute: %s",
                      len(corrupt), op.req_id, errors[:2])
        if op.via:
            self._result.stored[op.op_id] = oks
        return oks

    def _copy_jobs_now(self, jobs: list) -> None:
        """Run copies into the KV on this thread (the CPU backend: before the forward)."""
        t1 = time.perf_counter()
        rows = [j for j in jobs if j[0] == "rows"]
        if rows:
            self._copy_rows_parallel(rows, to_kv=True)
        self._copy_s += time.perf_counter() - t1
        views = [j for j in jobs if j[0] == "views"]
        if views:  # counts its own time
            self._copy_layers(views, [threading.Event() for _ in self.layout.tensors])

    def start_load(self) -> None:
        """Read what this step loads (NVMe reads and checksums now), then copy into vLLM's KV:
        on a GPU layer by layer on the loader thread (the forward waits per layer, wait_layer);
        on the CPU backend now, NVMe chunks as their reads land."""
        meta = self._meta
        if meta is None or not meta.loads or self.layout is None:
            return
        self.finish_loads()
        self._open_nvme(meta)
        t0 = time.perf_counter()
        self._copy_s = 0.0
        copy_now = self.layout.device.type == "cpu"
        jobs: list[tuple] = []  # ("rows", rows3, runs) or ("views", dst views, src views)
        # NVMe loads without CPU slots each get their own staging rows for this step
        staged = sum(len(op.slots) for op in meta.loads if op.tier != 0 and not op.via)
        stage = self._staging_views(staged) if staged else []
        row0 = 0
        for op in meta.loads:
            name = self._tier_name(op.tier)
            oks = [False] * len(op.slots)
            try:
                if self.fail_loads:
                    raise RuntimeError("fail_loads test hook")
                if op.tier == 0:
                    if self._runs_ok:
                        jobs.append(("rows", self._pool3[0], _runs(op.block_ids, op.slots)))
                    else:
                        jobs.append(("views", self._gpu_views(op.block_ids), self._tier_views(op.tier, op.slots)))
                    oks = [True] * len(op.slots)
                else:
                    oks = self._load_nvme(op, jobs, stage, row0, copy_now)
            except Exception as e:
                log.warning("kvtier: load of %d blocks for %s failed: %s", len(op.slots), op.req_id, e)
                if op.via:
                    self._result.stored[op.op_id] = [False] * len(op.slots)
            if op.tier != 0 and not op.via:
                row0 += len(op.slots)
            self._load_done.append((op, name, oks))
        meta.loads = []  # a second start_load_kv call in the same step loads nothing twice
        if jobs and not copy_now:
            # a GPU: copies on the loader thread's stream overlap the forward, layer by layer
            self._sync_s = time.perf_counter() - t0  # NVMe reads + checksums, before the forward
            L = len(self.layout.tensors)
            self._layer_events = [threading.Event() for _ in range(L)]
            if self._loader is None:
                self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvtier-load")
            self._load_job = self._loader.submit(self._copy_layers, jobs, self._layer_events)
            return
        if jobs:
            self._copy_jobs_now(jobs)
        self._sync_s = time.perf_counter() - t0 - self._copy_s  # NVMe reads + checksums not hidden
        self.finish_loads()

    def _copy_layers(self, jobs, events: list[threading.Event]) -> None:
        L = len(events)
        try:
            for li in range(L):
                t0 = time.perf_counter()
                d: list[torch.Tensor] = []
                s: list[torch.Tensor] = []
                for kind, a, b in jobs:
                    if kind == "rows":
                        self._copy_runs(li, a, b, to_kv=True)
                    else:  # block-major view lists: layer li is every L-th view
                        d.extend(a[li::L])
                        s.extend(b[li::L])
                if d:
                    self._copy(d, s)
                self._copy_s += time.perf_counter() - t0
                events[li].set()
        finally:
            for e in events:  # never leave the forward waiting
                e.set()

    def wait_layer(self, layer_name: str) -> None:
        events = self._layer_events
        if events is None:
            return
        li = self.layout.layer_of.get(layer_name) if self.layout is not None else None
        if li is None:
            self.finish_loads()
        else:
            events[li].wait()

    def finish_loads(self) -> None:
        """Wait for this step's copies; account them; a failed copy makes its blocks load errors."""
        job, self._load_job = self._load_job, None
        failed = None
        if job is not None:
            try:
                job.result()
            except Exception as e:  # pragma: no cover - a host memcpy does not fail
                failed = e
                log.warning("kvtier: layer copies failed: %s", e)
        self._layer_events = None
        done, self._load_done = self._load_done, []
        busy = self._sync_s + self._copy_s  # time spent loading (the copies overlap the forward)
        for op, name, oks in done:
            if failed is not None:
                oks = [False] * len(oks)
            bad = [b for b, ok in zip(op.block_ids, oks) if not ok]
            if bad:
                self._load_errors.update(bad)
            self._result.loaded[op.req_id] = self._result.loaded.get(op.req_id, True) and not bad
            n = sum(oks)
            if n:
                self._count(f"bytes_loaded.{name}", n * self.layout.block_bytes)
                self._count(f"seconds_loaded.{name}", busy / max(1, len(done)))
                self._count(f"blocks_loaded.{name}", n)
            if bad:
                self._count(f"blocks_load_failed.{name}", len(bad))

    def save(self) -> None:
        self.finish_loads()
        meta = self._meta
        if meta is None or self.layout is None or not (meta.stores or meta.nvme_writes):
            return
        failed_cpu: set[int] = set()
        for op in meta.stores:
            name = self._tier_name(op.tier)
            t0 = time.perf_counter()
            try:
                if op.tier >= len(self.pools):
                    raise RuntimeError(f"tier {op.tier} has no data plane on this worker")
                if self._runs_ok and self._pool3[op.tier] is not None:
                    self._copy_rows_parallel([("rows", self._pool3[op.tier], _runs(op.block_ids, op.slots))],
                                             to_kv=False)
                else:
                    self._copy(self._tier_views(op.tier, op.slots), self._gpu_views(op.block_ids))
                oks = [True] * len(op.slots)
            except Exception as e:
                log.warning("kvtier: store of %d blocks failed: %s", len(op.slots), e)
                oks = [False] * len(op.slots)
                failed_cpu.update(op.slots)
            dt = time.perf_counter() - t0
            self._result.stored[op.op_id] = oks
            n = sum(oks)
            self._count(f"bytes_stored.{name}", n * self.layout.block_bytes)
            self._count(f"seconds_stored.{name}", dt)
            self._count(f"blocks_stored.{name}", n)
        meta.stores = []
        if meta.nvme_writes:
            self._write_nvme(meta, failed_cpu)

    def _write_nvme(self, meta: KVTierMetadata, failed_cpu: set[int]) -> None:
        """Queue CPU slots -> NVMe slots; the flusher writes, fdatasyncs and returns per-slot
        checksums (-1: not durable), reported by `take_result` once done (see `_reap_writes`)."""
        ops, meta.nvme_writes = list(meta.nvme_writes), []
        try:
            self._open_nvme(meta)
            if self.nvme is None:
                raise RuntimeError("no NVMe data plane on this worker (no nvme_dir in the metadata)")
            batch = []
            for op in ops:
                sums = [0] * len(op.slots)
                srcs = [self.pools[0].views[s] for s in op.src_slots]
                batch.append((op, sums, self.nvme.write(op.slots, srcs, sums)))
        except Exception as e:
            log.warning("kvtier: NVMe write-through of %d ops failed: %s", len(ops), e)
            for op in ops:
                self._result.nvme_written[op.op_id] = [-1] * len(op.slots)
            return
        if self._flusher is None:
            self._flusher = ThreadPoolExecutor(1, thread_name_prefix="kvtier-nvme-flush")
        fut = self._flusher.submit(self._flush, self.nvme, batch, set(failed_cpu), time.perf_counter())
        self._writes.append((self._step, fut))
        if self._write_lag == 0:
            self._reap_writes(wait=True)

    @staticmethod
    def _flush(nvme, batch, failed_cpu: set[int], t0: float) -> tuple[list, float]:
        """Flusher thread: wait for a batch's writes, fdatasync once, per-op checksums (-1: failed)."""
        try:
            results = [(op, sums, h.wait()) for op, sums, h in batch]
            if any(any(r.ok) for _, _, r in results):
                nvme.sync()
        except Exception as e:
            log.warning("kvtier: NVMe write-through failed: %s", e)
            return [(op, [-1] * len(op.slots)) for op, _, _ in batch], time.perf_counter() - t0
        out = [(op, [c if ok and src not in failed_cpu else -1 for c, ok, src in zip(sums, r.ok, op.src_slots)])
               for op, sums, r in results]
        return out, time.perf_counter() - t0

    def _reap_writes(self, wait: bool = False) -> None:
        """Report finished write batches; wait for those `nvme_write_lag_steps` old (all if `wait`)."""
        keep = []
        for step, fut in self._writes:
            if not (wait or fut.done() or self._step - step >= self._write_lag):
                keep.append((step, fut))
                continue
            done, dt = fut.result()
            n = 0
            for op, out in done:
                self._result.nvme_written[op.op_id] = out
                n += sum(1 for c in out if c >= 0)
            self._count("bytes_stored.nvme", n * self.layout.block_bytes)
            self._count("seconds_stored.nvme", dt)
            self._count("blocks_stored.nvme", n)
        self._writes = keep

    @property
    def writes_in_flight(self) -> int:
        return len(self._writes)

    def take_result(self) -> KVTierWorkerMeta | None:
        """This step's report (called once per step): loads, stores, NVMe writes now durable."""
        self.finish_loads()
        self._reap_writes()
        self._step += 1
        r = self._result
        if not r.stored and not r.loaded and not r.nvme_written and not r.corrupt:
            return None
        self._result = KVTierWorkerMeta(rank=self.rank)
        return r

    def take_load_errors(self) -> set[int]:
        self.finish_loads()
        e, self._load_errors = self._load_errors, set()
        return e

    def stats(self) -> dict:
        return {"totals": dict(self.totals), "layout": self.layout.describe() if self.layout else None,
                "pools": [{"slots": p.num_slots, "pinned": p.pinned} for p in self.pools],
                "nvme": {"path": self.nvme.path, "engine": self.nvme.description} if self.nvme else None,
                "corrupt_blocks": self.corrupt_blocks}

    def close(self, timeout_s: float | None = None) -> KVTierWorkerMeta | None:
        """Shut down: finish loads, wait up to `timeout_s` (default `SHUTDOWN_FLUSH_TIMEOUT_S`) for
        the pending NVMe write-back, free the memory. Returns the report no step carried yet (NVMe
        writes made durable since the last step, for the scheduler to commit), or None."""
        self.finish_loads()
        final = None
        late: set = set()
        if self._writes:
            t0 = time.monotonic()
            limit = SHUTDOWN_FLUSH_TIMEOUT_S if timeout_s is None else timeout_s
            pending = [f for _, f in self._writes]
            _, late = wait_futures(pending, timeout=limit)
            self._writes = [(st, f) for st, f in self._writes if f not in late]
            self._reap_writes(wait=True)
            n = sum(1 for v in self._result.nvme_written.values() for c in v if c >= 0)
            if late:
                log.error("kvtier: shutdown: %d of %d NVMe write batches still running after %.1f s; "
                          "left behind (their blocks are not indexed)", len(late), len(pending), limit)
            log.info("kvtier: shutdown: NVMe write-back flushed, %d blocks in %d batches in %.2f s",
                     n, len(pending) - len(late), time.monotonic() - t0)
            if n:  # durable on disk; indexed only if the scheduler gets this report
                self._count("nvme_unreported_blocks", n)
        r = self._result
        if r.stored or r.loaded or r.nvme_written or r.corrupt:
            final, self._result = r, KVTierWorkerMeta(rank=self.rank)
        if self._flusher is not None:
            self._flusher.shutdown(wait=not late, cancel_futures=True)
            self._flusher = None
        self._writes = []
        if late:  # a write still reads the CPU pool and the data file: leave both to process exit
            return final
        if self._loader is not None:
            self._loader.shutdown(wait=True)
            self._loader = None
        if self.nvme is not None:
            self.nvme.close()
            self.nvme = None
        self._staging = None
        self._slot_layer = []
        self._pool3 = []
        self._flat_np = []
        for p in self.pools:
            p.close()
        self.pools = []
        return final
