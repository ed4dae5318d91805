"""Worker side of the connector: the executor of the controller's plan inside vLLM.

It runs the step's ops (`kvtier.core.plan`): `LoadOp`s in `start_load_kv` (NVMe reads, each block
verified against its key and tag, then copies into vLLM's KV: on a GPU layer by layer on a
loader thread, `wait_for_layer_load` waiting per layer; on the CPU backend at once, NVMe
chunks as their reads land), `StoreOp`s in `wait_for_save` (after the forward that wrote
them), and CPU -> NVMe copies (`CopyOp`) written behind: a flusher thread writes,
fdatasyncs and hands the per-slot tags to the report of a later step (at most
`nvme_write_lag_steps` later; 0 = this step). The report (`KVTierWorkerMeta`) goes back to
the controller. Jobs live next door: `kv_layout.py` (vLLM's KV layout, gather / scatter),
`staging.py` (rows for NVMe loads without a CPU slot), `kvtier.tiers.cpu_pool` (the pool),
`kvtier.tiers.nvme_data` (the data file).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from kvtier.core.once import Once, cause
from kvtier.tiers.cpu_pool import CpuPool

from kvtier.tiers.handles import DoneHandle, IOResult

from .kv_layout import KVCopier, KVLayout, RowCopy, ViewCopy
from .startup import fit_pool_slots
from .metadata import Counting, KVTierMetadata, KVTierWorkerMeta
from kvtier.core.write_behind import WriteBehind
from kvtier.core.staging import Staging

log = logging.getLogger("kvtier.connector")

SHUTDOWN_FLUSH_TIMEOUT_S = 30.0  # close(): longest wait for pending NVMe write-back
NVME_REOPEN_S = 30.0             # an NVMe data file that failed to open is tried again after this


class KVTierWorker(Counting):
    def __init__(self, cpu_blocks_fn, pin: str | bool = "auto", expected_block_bytes: int | None = None,
                 nvme_io: str = "auto", nvme_io_threads: int = 4, nvme_direct: bool | str = "auto",
                 nvme_write_lag_steps: int = 4, rank: int = 0, remote_fn=None, ranks: int = 1,
                 num_blocks: int | None = None, copy_streams=None, cpu_tier=None) -> None:
        """`remote_fn(block_bytes, count)`: opens the shared tier's data plane (`RedisData`) for
        this rank, or None when the stack has no shared tier. `num_blocks`: vLLM's KV-cache blocks
        (the tensors may hold more kernel blocks, `KVLayout`); `expected_block_bytes`: what the
        scheduler sized its tiers with (a layout that disagrees is refused). `copy_streams`:
        forces the device copier with these streams (tests)."""
        self._num_blocks = num_blocks
        self._cpu_tier = cpu_tier            # TierConfig of the cpu tier (else cpu_blocks_fn(block bytes) slots)
        self._copy_streams = copy_streams
        self._cpu_blocks_fn = cpu_blocks_fn
        self._remote_fn = remote_fn
        self.remote = None                    # RedisData: the shared tier's data plane
        self._pin = pin
        self._expected = expected_block_bytes
        self.layout: KVLayout | None = None
        self.pools: list[CpuPool] = []
        self.kv: KVCopier | None = None       # gather/scatter between vLLM's KV and the CPU pool
        self._meta: KVTierMetadata | None = None
        self.rank = rank                      # this worker's shard: NVMe file data.<rank>, its own checksums
        self._ranks = ranks                   # workers on this host, each with its own pool
        self._result = KVTierWorkerMeta(rank=rank)
        self._load_errors: set[int] = set()
        self._init_counters()
        self.tier_names = ["cpu", "nvme"]
        self.nvme = None                      # NvmeData, opened on the first step that names its dir
        self._nvme_failed_at: float | None = None   # its last failed open (retried after NVME_REOPEN_S)
        self._once = Once(log)                # a failure that repeats every step: one line per cause
        self.disabled = False                 # register_kv_caches failed: every load fails, nothing stored
        self._nvme_args = (nvme_io, nvme_io_threads, nvme_direct)
        self.staging: Staging | None = None   # rows for NVMe loads without CPU slots
        self.nvme_load_chunk_bytes = 8 << 20  # CPU backend: copy NVMe loads into the KV per chunk read
        self.corrupt_blocks = 0
        # write-behind: batches of NVMe writes in flight, oldest first: (step, future of results)
        self.writes = WriteBehind(nvme_write_lag_steps)
        self._async: dict[str, list] = {}     # request -> its load ops, loading asynchronously
        self._recv_failed: set[str] = set()   # asynchronous loads that failed: reported as received
        self._fetched: dict[int, tuple] = {}  # id(op) -> (host rows, rows, buffers, handle): reads ahead
        self._remote_tier: int | None = None
        self.puts = WriteBehind(nvme_write_lag_steps)   # shared-tier writes, reported the same way
        self._step = 0
        # layer-pipelined loads on a GPU: copies enqueued on a side stream before the forward, one
        # event per layer that the forward's stream waits on (wait_layer); the host syncs the last
        self._load_event = None
        self._layer_events: list | None = None
        self._load_done: list[tuple[Any, str, list[bool]]] = []
        self._sync_s = self._copy_s = 0.0
        # test hook: corrupt / fail loads on purpose
        self.fail_loads = False

    # ---- setup -------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Take vLLM's KV tensors. A second call (vLLM re-registering, e.g. after sleep mode)
        keeps the CPU pool and its blocks when the block is the same size; otherwise refused."""
        lay = KVLayout(kv_caches, self._num_blocks)
        if self._expected is not None and self._expected != lay.block_bytes:
            raise ValueError(f"kvtier: block is {lay.block_bytes} B on the worker but the scheduler "
                             f"sized its tiers for {self._expected} B")
        if self.pools:
            if self.pools[0].block_bytes != lay.block_bytes:
                raise ValueError(f"kvtier: KV re-registered with {lay.block_bytes} B blocks, the CPU pool "
                                 f"holds {self.pools[0].block_bytes} B blocks")
            self.finish_loads()
            self.layout = lay
            self.kv = KVCopier(lay, self.pools[0], self._copy_streams)
            log.info("kvtier worker: KV re-registered (%s); cpu pool kept, %d slots", lay.describe(),
                     self.pools[0].num_slots)
            return
        self.layout = lay
        from kvtier.core.config import TierConfig
        tier = self._cpu_tier or TierConfig(name="cpu", kind="cpu",
                                            capacity_blocks=self._cpu_blocks_fn(lay.block_bytes))
        n, warning = fit_pool_slots(tier, lay.block_bytes, self._ranks)
        if warning:
            log.warning("%s", warning)
            self._count("cpu_pool_shrunk", 1)
        self._result.capacity[0] = n   # the scheduler's tier follows (its first report)
        pool = CpuPool(n, lay.block_bytes, self._pin)
        self.pools = [pool]
        self.kv = KVCopier(lay, pool, self._copy_streams)
        self.staging = Staging(lay.block_bytes, self._pin)
        log.debug("kvtier worker: %s; cpu pool %d slots", lay.describe(), n)
        if self._remote_fn is not None and self.remote is None:
            self.remote = self._remote_fn(lay.block_bytes, self._count)
            why = self.remote.ping()
            if why:
                log.warning("kvtier worker: shared tier %s not reachable now (%s): misses until it answers",
                            self.remote.s.where, why)

    # ---- per step ----------------------------------------------------------------------
    def _tier_name(self, tier: int) -> str:
        meta = self._meta
        if meta is not None and meta.tier_names:
            return meta.tier_names[tier] if tier < len(meta.tier_names) else str(tier)
        return self.tier_names[tier] if tier < len(self.tier_names) else str(tier)

    def bind(self, meta: Any) -> None:
        self._meta = meta if isinstance(meta, KVTierMetadata) else None

    def disable(self) -> None:
        """register_kv_caches failed: this worker loads nothing (load errors) and stores nothing."""
        self.disabled = True

    def _open_nvme(self, meta: KVTierMetadata) -> None:
        """Open the NVMe data file the metadata names. Never raises: a file that cannot be opened
        or sized (disk full, read-only, gone) leaves `self.nvme` None, so this step's NVMe loads are
        load errors (vLLM recomputes) and its writes are dropped; logged once, counted, and tried
        again after NVME_REOPEN_S."""
        if meta.nvme_dir is None or self.layout is None:
            return
        if self.nvme is not None and self.nvme.dir == meta.nvme_dir:
            return
        now = time.monotonic()
        if self._nvme_failed_at is not None and now - self._nvme_failed_at < NVME_REOPEN_S:
            return
        from .nvme import NvmeData
        if self.nvme is not None:
            self._reap_writes(wait=True)
            self.nvme.close()
            self.nvme = None
        io, threads, direct = self._nvme_args
        try:
            self.nvme = NvmeData(meta.nvme_dir, meta.nvme_capacity, self.layout.block_bytes, io, threads, direct,
                                 rank=self.rank)
        except Exception as e:  # noqa: BLE001 - any failure to open is a tier unavailable, not a crash
            self._nvme_failed_at = now
            self._count("nvme_open_failed")
            self._once(("nvme_open",) + cause(e), logging.ERROR,
                       "kvtier: NVMe data file under %s cannot be opened (%s); NVMe loads are recomputed and "
                       "writes dropped until it can (tried again every %.0f s)", meta.nvme_dir, e, NVME_REOPEN_S)
            return
        if self._nvme_failed_at is not None:
            log.warning("kvtier: NVMe data file %s open again", self.nvme.path)
            self._nvme_failed_at = None

    def _load_lower(self, op, jobs: list, stage: list[torch.Tensor], row0: int, copy_now: bool,
                    remote: bool) -> list[bool]:
        """NVMe slots or shared-tier keys -> (CPU slots `op.via`, or staging rows row0..), each
        block verified; the copies into the KV go to `jobs`, or with `copy_now` run chunk by chunk
        as each chunk's reads land (the next chunks are still reading meanwhile)."""
        n = len(op.slots)
        pre = self._fetched.pop(id(op), None) if remote else None
        if remote and pre is None:
            if self.remote is None:
                raise RuntimeError("no shared-tier data plane on this worker")
            if not op.keys or len(op.keys) != n:
                raise RuntimeError("shared-tier load without keys")
        elif not remote:
            if self.nvme is None:
                raise RuntimeError("no NVMe data plane on this worker (no nvme_dir in the metadata)")
            if op.checksums is None or len(op.checksums) != n:
                raise RuntimeError("NVMe load without expected checksums")
        # the rows the blocks are read into, then copied from: CPU slots, rows of its own (read
        # ahead), or this op's staging rows
        if pre is not None:  # read ahead (an asynchronous load)
            host, rows, bufs, h = pre
            reads = [(0, [False] * n, h)]
        else:
            host, rows = (self.kv.pool_rows, op.via) if op.via else (self.staging.rows(), range(row0, row0 + n))
            bufs = [self.pools[0].views[s] for s in op.via] if op.via else stage[row0:row0 + n]
            step = max(1, self.nvme_load_chunk_bytes // self.layout.block_bytes) if copy_now else n
            reads = []  # all chunks in flight at once: the engine's pool keeps the disk / server busy
            for lo in range(0, n, step):
                hi = min(n, lo + step)
                bad = [False] * (hi - lo)
                if remote:
                    reads.append((lo, bad, self.remote.get(op.keys[lo:hi], bufs[lo:hi])))
                else:
                    reads.append((lo, bad, self.nvme.read(op.slots[lo:hi], bufs[lo:hi], op.checksums[lo:hi], bad,
                                                         keys=op.keys[lo:hi] if op.keys else None)))
        kv = self.kv
        oks: list[bool] = []
        corrupt: list[int] = []
        errors: list[str] = []
        for lo, bad, h in reads:
            r = h.wait()
            oks.extend(r.ok)
            errors.extend(r.errors)
            if remote:  # absent (the server evicted it) or failed verification: a miss, reported
                self._result.gone.extend(op.keys[lo + i] for i, ok in enumerate(r.ok) if not ok)
            corrupt.extend(op.slots[lo + i] for i, b in enumerate(bad) if b)
            good = [lo + i for i, ok in enumerate(r.ok) if ok]
            if not good:
                continue
            job = kv.rows_job(host, [op.block_ids[i] for i in good], [rows[i] for i in good],
                              [bufs[i] for i in good])
            if copy_now:
                self._copy_jobs_now([job])
            else:
                jobs.append(job)
        if corrupt:
            self.corrupt_blocks += len(corrupt)
            self._count("corrupt_blocks.nvme", len(corrupt))
            self._result.corrupt.setdefault(op.tier, []).extend(corrupt)
            self._once(("corrupt", op.tier), logging.ERROR,
                       "kvtier: %d NVMe blocks of %s failed their checksum; reported for recompute, quarantined: "
                       "%s", len(corrupt), op.req_id, errors[:2])
        if op.via:
            self._result.stored[op.op_id] = oks
        return oks

    def _copy_jobs_now(self, jobs: list[RowCopy | ViewCopy]) -> None:
        """Run copies into the KV on this thread (the CPU backend: before the forward)."""
        t1 = time.perf_counter()
        self.kv.run(jobs, to_kv=True)
        self._copy_s += time.perf_counter() - t1

    def start_load(self) -> None:
        """Read what this step loads (NVMe reads and checksums now), then copy into vLLM's KV:
        on a GPU layer by layer on the loader thread (the forward waits per layer, wait_layer);
        on the CPU backend now, NVMe chunks as their reads land. Requests vLLM loads
        asynchronously (`meta.async_loads`: a shared-tier hit) only start their shared-tier
        reads here; `poll_async` finishes them in a later step."""
        meta = self._meta
        if meta is None:
            return
        if meta.failed_loads:  # loads the scheduler accepted but could not plan: vLLM recomputes them
            for rid, ids in meta.failed_loads.items():
                self._fail_blocks(rid, ids, "planning")
            meta.failed_loads = {}
        if not meta.loads:
            return
        if self.layout is None or self.disabled:
            self.fail_step_loads()
            return
        self.finish_loads()
        self._remote_tier = meta.remote_tier
        if meta.async_loads:
            later = set(meta.async_loads)
            for op in meta.loads:
                if op.req_id in later:
                    self._async.setdefault(op.req_id, []).append(op)
                    if op.tier == meta.remote_tier:
                        self._prefetch(op)
            meta.loads = [op for op in meta.loads if op.req_id not in later]
        if any(op.tier != meta.remote_tier for op in meta.loads):
            self._open_nvme(meta)
        self._run_loads(meta.loads, layered=True)
        meta.loads = []  # a second start_load_kv call in the same step loads nothing twice

    def _prefetch(self, op) -> None:
        """Start an asynchronous load's shared-tier reads into its CPU slots (promotion) or rows
        of its own, kept until `poll_async` copies them into the KV."""
        n = len(op.keys or [])
        if op.via:
            host, rows = self.kv.pool_rows, list(op.via)
        else:
            host, rows = torch.empty((n, self.layout.block_bytes), dtype=torch.uint8), list(range(n))
        bufs = [host[r] for r in rows]
        try:
            if self.remote is None:
                raise RuntimeError("no shared-tier data plane on this worker")
            h = self.remote.get(op.keys, bufs)
        except Exception as e:
            self._once(("remote_read",) + cause(e), logging.WARNING,
                       "kvtier: shared-tier read of %d blocks for %s failed: %s", n, op.req_id, e)
            h = DoneHandle(IOResult(ok=[False] * n, errors=[str(e)]))
        self._fetched[id(op)] = (host, rows, bufs, h)

    IDLE_WAIT_S = 1.0   # a step with nothing but asynchronous loads waits this long for them at most

    def poll_async(self) -> set[str]:
        """Requests whose asynchronous loads arrived: their blocks go into the KV now (after the
        step's forward, on this thread), and vLLM schedules them from the next step. In a step
        with nothing else to run (`meta.idle`) it waits for them (bounded) instead of returning
        at once: the waiting thread lets go of the GIL, which the reads need (an engine loop
        spinning through empty steps would starve them)."""
        if self._async and self._meta is not None and self._meta.idle:
            deadline = time.monotonic() + self.IDLE_WAIT_S
            for ops in list(self._async.values()):
                for op in ops:
                    f = self._fetched.get(id(op))
                    left = deadline - time.monotonic()
                    if f is None or left <= 0:
                        continue
                    try:
                        f[-1].wait(left)
                    except Exception:  # still running (timeout) or failed: reported when done
                        pass
        done: set[str] = set()
        for rid, ops in list(self._async.items()):
            if any(not self._fetched[id(op)][-1].done() for op in ops if id(op) in self._fetched):
                continue
            del self._async[rid]
            if any(op.tier != self._remote_tier for op in ops) and self._meta is not None:
                self._open_nvme(self._meta)
            self._run_loads(ops, layered=False)
            done.add(rid)
        if done:
            self.finish_loads()
        if self._recv_failed:
            done |= self._recv_failed
            self._recv_failed = set()
        return done

    def _run_loads(self, ops: list, layered: bool) -> None:
        if not ops:
            return
        self.finish_loads()  # the last step's copies may still read the staging rows handed out again here
        t0 = time.perf_counter()
        self._copy_s = 0.0
        copy_now = self.kv.device is None or not layered  # layered: the device copier (a GPU)
        jobs: list[RowCopy | ViewCopy] = []
        # lower-tier loads without CPU slots each get their own staging rows for this step
        staged = sum(len(op.slots) for op in ops if op.tier != 0 and not op.via and id(op) not in self._fetched)
        stage = self.staging.views(staged) if staged else []
        row0 = 0
        for op in ops:
            name = self._tier_name(op.tier)
            own = id(op) in self._fetched
            oks = [False] * len(op.slots)
            try:
                if self.fail_loads:
                    raise RuntimeError("fail_loads test hook")
                self._check_slots(op.via)
                if op.tier == 0:
                    self._check_slots(op.slots)
                    jobs.append(self.kv.pool_job(op.block_ids, op.slots))
                    oks = [True] * len(op.slots)
                else:
                    oks = self._load_lower(op, jobs, stage, row0, copy_now, op.tier == self._remote_tier)
            except Exception as e:
                self._once(("load", name) + cause(e), logging.WARNING,
                           "kvtier: load of %d blocks for %s from %s failed: %s (recomputed by vLLM)",
                           len(op.slots), op.req_id, name, e)
                if op.via:
                    self._result.stored[op.op_id] = [False] * len(op.slots)
            if op.tier != 0 and not op.via and not own:  # read ahead into rows of its own instead
                row0 += len(op.slots)
            self._load_done.append((op, name, oks))
        if jobs and not copy_now:
            # a GPU: copies on the side stream overlap the forward; each layer's attention waits
            # for its own event (wait_layer), the host for none of them
            self._sync_s = time.perf_counter() - t0  # NVMe reads + checksums, before the forward
            t1 = time.perf_counter()
            self._layer_events = self.kv.load_layered(jobs)
            self._copy_s += time.perf_counter() - t1
            self._load_event = self._layer_events[-1] if self._layer_events else None
            return
        if jobs:
            self._copy_jobs_now(jobs)
        self._sync_s = time.perf_counter() - t0 - self._copy_s  # NVMe reads + checksums not hidden
        self.finish_loads()

    def wait_layer(self, layer_name: str) -> None:
        """The forward is about to run `layer_name`'s attention: its blocks must be in place."""
        events = self._layer_events
        if events is None:
            return
        li = self.layout.layer_of.get(layer_name) if self.layout is not None else None
        self.kv.wait_layer(events[-1] if li is None else events[li])

    def finish_loads(self) -> None:
        """Wait for this step's copies; account them; a failed copy makes its blocks load errors."""
        ev, self._load_event = self._load_event, None
        failed = None
        if ev is not None:
            try:
                self.kv.sync(ev)
            except Exception as e:  # pragma: no cover - a failed device copy
                failed = e
                self._once(("layer_copies",) + cause(e), logging.ERROR, "kvtier: copies into the KV failed: %s "
                           "(the blocks are load errors: vLLM recomputes them)", e)
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
        if meta is None or not (meta.stores or meta.copies):
            return
        if self.layout is None or self.disabled:
            self.fail_step_stores()
            return
        failed_cpu: set[int] = set()
        # A load of this step failed: vLLM recomputes those blocks, but this step's forward
        # already computed the blocks after them over their stale contents. Which stored blocks
        # belong to that request is not known here, so nothing of this step is stored.
        tainted = bool(self._load_errors)
        if tainted and meta.stores:
            self._once(("tainted",), logging.WARNING, "kvtier: a load failed this step: its %d stores are "
                       "dropped (computed over blocks vLLM recomputes)", len(meta.stores))
        t0 = time.perf_counter()
        planned: list[tuple] = []  # (op, its copy job): every store of the step in one batch
        for op in meta.stores:
            try:
                if tainted:
                    raise RuntimeError("a load failed this step")
                if op.tier != 0 or self.kv is None:
                    raise RuntimeError(f"tier {op.tier} has no data plane on this worker")
                self._check_slots(op.slots)
                planned.append((op, self.kv.pool_job(op.block_ids, op.slots)))
            except Exception as e:  # noqa: BLE001 - this op's store fails, the others run
                self._store_failed(op, e, tainted, failed_cpu)
        if planned:
            try:  # after the forward (a GPU: the side stream waits on it), one sync for the step
                self.kv.sync(self.kv.store_async([j for _, j in planned]))
            except Exception as e:  # noqa: BLE001
                for op, _ in planned:
                    self._store_failed(op, e, False, failed_cpu)
                planned = []
        dt = time.perf_counter() - t0
        for op, _ in planned:
            self._result.stored[op.op_id] = [True] * len(op.slots)
        by_tier: dict[str, int] = {}
        for op, _ in planned:
            name = self._tier_name(op.tier)
            by_tier[name] = by_tier.get(name, 0) + len(op.slots)
        for name, n in by_tier.items():
            self._count(f"bytes_stored.{name}", n * self.layout.block_bytes)
            self._count(f"seconds_stored.{name}", dt)
            self._count(f"blocks_stored.{name}", n)
        meta.stores = []
        if meta.copies:
            self._write_nvme(meta, failed_cpu)

    def _write_nvme(self, meta: KVTierMetadata, failed_cpu: set[int]) -> None:
        """Queue CPU slots -> NVMe slots; the flusher writes, fdatasyncs and returns per-slot
        checksums (-1: not durable), reported by `take_result` once done (see `_reap_writes`).
        Copies to the shared tier go to its data plane the same way (0: written, -1: not)."""
        ops, meta.copies = list(meta.copies), []
        puts = [op for op in ops if op.tier == meta.remote_tier]
        ops = [op for op in ops if op.tier != meta.remote_tier]
        if puts:
            self._put_remote(puts, failed_cpu)
        if not ops:
            return
        batch: list = []
        try:
            self._open_nvme(meta)
            if self.nvme is None:
                raise RuntimeError("no NVMe data plane on this worker (no nvme_dir in the metadata)")
            for op in ops:  # every check before the first write is handed to the engine
                self._check_slots(op.src_slots)
            for op in ops:
                sums = [0] * len(op.slots)
                srcs = [self.pools[0].views[s] for s in op.src_slots]
                batch.append((op, sums, self.nvme.write(op.slots, srcs, sums, keys=op.keys)))
        except Exception as e:  # noqa: BLE001 - the writes not handed to the engine are dropped
            started = {id(b[0]) for b in batch}
            self._once(("nvme_write",) + cause(e), logging.WARNING,
                       "kvtier: NVMe write of %d ops not started: %s (dropped; the CPU copies stay)",
                       len(ops) - len(started), e)
            for op in ops:
                if id(op) not in started:
                    self._result.copied[op.op_id] = [-1] * len(op.slots)
            if not batch:
                return
        self.writes.submit(self._step, self.nvme, batch, failed_cpu)
        if self.writes.lag == 0:
            self._reap_writes(wait=True)

    def _put_remote(self, ops: list, failed_cpu: set[int]) -> None:
        # a CPU slot whose store failed this step holds stale bytes: never sent to the server
        # (an NVMe write of one is only left unindexed; on the server, others would read it)
        bad = [op for op in ops if failed_cpu.intersection(op.src_slots)]
        for op in bad:
            self._result.copied[op.op_id] = [-1] * len(op.src_slots)
        ops = [op for op in ops if not failed_cpu.intersection(op.src_slots)]
        if not ops:
            return
        try:
            for op in ops:
                self._check_slots(op.src_slots)
            if self.remote is None:
                raise RuntimeError("no shared-tier data plane on this worker")
            batch = [(op, [0] * len(op.src_slots),
                      self.remote.put(op.keys, [self.pools[0].views[s] for s in op.src_slots])) for op in ops]
        except Exception as e:
            self._once(("remote_write",) + cause(e), logging.WARNING,
                       "kvtier: shared-tier write of %d ops failed: %s", len(ops), e)
            for op in ops:
                self._result.copied[op.op_id] = [-1] * len(op.src_slots)
            return
        self.puts.submit(self._step, self.remote, batch, failed_cpu)
        if self.puts.lag == 0:
            self._reap_writes(wait=True)

    def _reap_writes(self, wait: bool = False) -> None:
        """Report finished write batches; wait for those `nvme_write_lag_steps` old (all if `wait`)."""
        shared = self.remote.name if self.remote is not None else "shared"
        for behind, name in ((self.writes, "nvme"), (self.puts, shared)):
            for done, dt in behind.reap(self._step, wait):
                n = 0
                for op, out in done:
                    self._result.copied[op.op_id] = out
                    n += sum(1 for c in out if c >= 0)
                self._count(f"bytes_stored.{name}", n * self.layout.block_bytes)
                self._count(f"seconds_stored.{name}", dt)
                self._count(f"blocks_stored.{name}", n)

    @property
    def loads_in_flight(self) -> int:
        """Requests whose asynchronous load has not arrived yet."""
        return len(self._async)

    @property
    def writes_in_flight(self) -> int:
        return len(self.writes) + len(self.puts)

    def take_result(self, finish: bool = True) -> KVTierWorkerMeta | None:
        """This step's report (called once per step): loads, stores, NVMe writes now durable.
        `finish=False` (recovering from a failure): the report as it stands."""
        if finish:
            self.finish_loads()
            self._reap_writes()
        self._step += 1
        r = self._result
        if r.is_empty():
            return None
        self._result = KVTierWorkerMeta(rank=self.rank)
        return r

    def take_load_errors(self, finish: bool = True) -> set[int]:
        if finish:
            self.finish_loads()
        e, self._load_errors = self._load_errors, set()
        return e

    # ---- failures: the safe answer when a step's work cannot run (connector/guard.py) ----------
    def _store_failed(self, op, e: BaseException, tainted: bool, failed_cpu: set[int]) -> None:
        """A store op that did not run: its slots are released by the scheduler (a future miss)."""
        if not tainted:
            name = self._tier_name(op.tier)
            self._once(("store", name) + cause(e), logging.WARNING,
                       "kvtier: store of %d blocks to %s failed: %s", len(op.slots), name, e)
        self._result.stored[op.op_id] = [False] * len(op.slots)
        failed_cpu.update(op.slots)

    def _check_slots(self, slots) -> None:
        """CPU slots must lie in this worker's pool (smaller than configured when it was shrunk to
        fit memory, until the scheduler's tier follows)."""
        if slots and max(slots) >= self.pools[0].num_slots:
            raise RuntimeError(f"CPU slot {max(slots)} beyond this worker's pool of {self.pools[0].num_slots}")

    def _fail_blocks(self, req_id: str, block_ids, why: str) -> None:
        """These blocks of the request were not loaded: vLLM recomputes them (a load error)."""
        ids = list(block_ids)
        self._load_errors.update(ids)
        self._result.loaded[req_id] = False
        self._count("blocks_load_failed", len(ids))
        self._once(("load_failed", why), logging.WARNING,
                   "kvtier: %d blocks of %s not loaded (%s): reported as load errors, vLLM recomputes them",
                   len(ids), req_id, why)

    def _fail_op(self, op, why: str) -> None:
        self._fail_blocks(op.req_id, op.block_ids, why)
        if op.via:  # a promotion read through CPU slots: those slots were not written
            self._result.stored[op.op_id] = [False] * len(op.slots)

    def fail_step_loads(self) -> None:
        """This step's loads cannot run: each of their blocks is a load error. A request vLLM
        loads asynchronously is also reported as received (with its errors), or it would wait forever."""
        meta = self._meta
        ops = list(meta.loads) if meta is not None else []
        if meta is not None:
            meta.loads = []
            self._recv_failed.update(meta.async_loads)
        for op in ops:
            self._fail_op(op, "the step's loads failed")
            self._fetched.pop(id(op), None)
            if op.req_id in self._async:
                self._recv_failed.add(op.req_id)
        self._layer_events = None

    def fail_async(self) -> set[str]:
        """Every asynchronous load still waiting fails (its blocks are load errors); returns the
        requests to report as received."""
        for rid, ops in list(self._async.items()):
            for op in ops:
                self._fail_op(op, "the asynchronous load failed")
                self._fetched.pop(id(op), None)
            self._recv_failed.add(rid)
        self._async.clear()
        out, self._recv_failed = self._recv_failed, set()
        return out

    def fail_step_stores(self) -> None:
        """This step's stores cannot run: dropped (each a future miss), their slots released by the
        scheduler; writes of CPU slots to lower tiers not handed to the engine yet are dropped too."""
        meta = self._meta
        if meta is None:
            return
        n = 0
        for op in meta.stores:
            if op.op_id not in self._result.stored:
                self._result.stored[op.op_id] = [False] * len(op.slots)
                n += len(op.slots)
        for op in meta.copies:
            self._result.copied[op.op_id] = [-1] * len(op.src_slots)
            n += len(op.src_slots)
        meta.stores, meta.copies = [], []
        self._count("blocks_store_dropped", n)

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
        for *_, h in list(self._fetched.values()):  # reads ahead into the CPU pool: let them land
            try:
                h.wait()
            except Exception:  # pragma: no cover - reported through the handle
                pass
        self._fetched.clear()
        self._async.clear()
        final = None
        late = late_puts = 0
        if len(self.puts):  # shared-tier writes: wait as long as the NVMe ones may, then leave them
            limit = SHUTDOWN_FLUSH_TIMEOUT_S if timeout_s is None else timeout_s
            late_puts = self.puts.drain(limit)
            if late_puts:
                log.warning("kvtier: shutdown: %d shared-tier write batches still running; left behind",
                            late_puts)
        if len(self.writes):
            t0 = time.monotonic()
            limit = SHUTDOWN_FLUSH_TIMEOUT_S if timeout_s is None else timeout_s
            pending = len(self.writes)
            late = self.writes.drain(limit)
            self._reap_writes(wait=True)
            n = sum(1 for v in self._result.copied.values() for c in v if c >= 0)
            if late:
                log.error("kvtier: shutdown: %d of %d NVMe write batches still running after %.1f s; "
                          "left behind (their blocks are not indexed)", late, pending, limit)
            log.info("kvtier: shutdown: NVMe write-back flushed, %d blocks in %d batches in %.2f s",
                     n, pending - late, time.monotonic() - t0)
            if n:  # durable on disk; indexed only if the scheduler gets this report
                self._count("nvme_unreported_blocks", n)
        r = self._result
        if not r.is_empty():
            final, self._result = r, KVTierWorkerMeta(rank=self.rank)
        self.writes.close(wait=not late)
        self.puts.close(wait=not late_puts)
        if late or late_puts:  # a write still reads the CPU pool (and the data file): leave them to exit
            return final
        if self.nvme is not None:
            self.nvme.close()
            self.nvme = None
        if self.remote is not None:
            self.remote.close()
            self.remote = None
        if self.staging is not None:
            self.staging.close()
            self.staging = None
        self.kv = None
        for p in self.pools:
            p.close()
        self.pools = []
        return final
