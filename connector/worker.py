"""Worker side of the connector: vLLM's KV layout and step hooks around the one executor.

What moves bytes is `kvtier.core.executor.Executor`, the same object the CLI and replay run;
this class adds only what is vLLM's: `register_kv_caches` (the KV layout, `kv_layout.py`, and
the CPU pool sized to the memory left), the step's metadata (which ops run in `start_load_kv`,
which in `wait_for_save`, which load asynchronously), layer-by-layer loads on a GPU
(`wait_for_layer_load`), the NVMe data file opened from the metadata, and the per-step report
(`KVTierWorkerMeta`). On a device, a store's copies run after `wait_for_save` returned and it is
reported in a later step (`PendingStores`); a finished request held for them is reported sent
once none of its stores still copies here (`SendingRequests`). Each hook's safe answer when it
fails is a method here (`load_failed`, `save_failed`, ...).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.common.counters import Metric
from kvtier.common.once import Once, cause
from kvtier.core.builder import tier_sealer
from kvtier.core.config import StackConfig
from kvtier.core.executor import Executor
from kvtier.core.plan import Counters
from kvtier.core.staging import Staging
from kvtier.tiers.cpu_pool import CpuPool
from kvtier.tiers.io_engine import fault_point
from kvtier.tiers.parts import PartsPlane

from .config import tier_of
from .kv_layout import KVCopier, KVLayout
from .parallel import Parts
from .metadata import HOLD_LIMIT_S, KVTierMetadata, KVTierStats, KVTierWorkerMeta, interval_stats
from .startup import fit_pool_slots

log = logging.getLogger("kvtier.connector")

SHUTDOWN_FLUSH_TIMEOUT_S = 30.0  # close(): longest wait for pending NVMe write-back
NVME_REOPEN_S = 30.0             # an NVMe data file that failed to open is tried again after this


class KVTierWorker:
    IDLE_WAIT_S = 1.0   # a step with nothing but asynchronous loads waits this long for them at most

    def __init__(self, cfg: StackConfig, rank: int = 0, ranks: int = 1, store_rank: int | None = None,
                 expected_block_bytes: int | None = None, num_blocks: int | None = None, shared_fn=None,
                 shared_needs_identity: bool = False, copy_streams=None, parts_of=None) -> None:
        """`cfg`: the stack's settings: its cpu tier sizes the pool (and `pin`s it), its nvme tier's
        `io`, `io_threads` and `direct` open the NVMe data file, `serving.nvme_write_lag_steps`;
        its tier names name the counters until the scheduler's first step does.
        `shared_fn(block_bytes, count, model, part, parts held)`: opens the shared tier's data plane
        (`SharedData`) of one part, or None without a shared tier; with `shared_needs_identity` it is
        opened at the first step whose metadata names the
        model's identity (the scheduler sends it once the weights' digest is done). `num_blocks`: vLLM's KV-cache blocks (the tensors may
        hold more kernel blocks, `KVLayout`); `expected_block_bytes`: what the scheduler sized its
        tiers with (a layout that disagrees is refused). `copy_streams`: forces the device copier
        with these streams (tests). `parts_of(layout)`: the parts of a stored block this worker
        holds and where each is in its row (`parallel.check_parts`); without it, one part per rank:
        `store_rank`'s (default its own rank; 0 on every rank when the ranks hold the same KV, MLA
        under tensor parallelism: only rank 0 writes the NVMe file and the shared tier)."""
        self._cpu_tier = tier_of(cfg, "cpu")
        if self._cpu_tier is None:
            raise ValueError("kvtier worker: the config has no cpu tier")
        nvme = tier_of(cfg, "nvme")
        self._tier_names = [t.name for t in cfg.storage_tiers()]
        self._shared_fn = shared_fn
        self._shared_needs_identity = shared_needs_identity
        self._pin = self._cpu_tier.pin
        self._expected = expected_block_bytes
        self._num_blocks = num_blocks
        self._copy_streams = copy_streams
        self._nvme_args = (nvme.io, nvme.io_threads, nvme.direct) if nvme is not None else ("auto", 4, "auto")
        self._nvme_sealer = tier_sealer(cfg, nvme)   # `sealing.Sealer`: the NVMe tier is encrypted
        self._lag = cfg.serving.nvme_write_lag_steps
        self.rank = rank
        self.store_rank = rank if store_rank is None else store_rank
        self._parts_of = parts_of
        self.parts: Parts | None = None       # the parts of a stored block this worker holds
        self._pieces: list = []               # ... where each is in its row
        self._ranks = ranks                   # workers on this host, each with its own pool
        self.counters = Counters()   # this worker's counters (its executor's too)
        self._once = Once(log)
        self.layout: KVLayout | None = None
        self.pools: list[CpuPool] = []
        self.kv: KVCopier | None = None       # the executor's outside: vLLM's KV
        self.shared = None                    # SharedData: the shared tier's data plane
        self.nvme = None                      # NvmeData, opened on the first step that names its dir
        self._nvme_failed_at: float | None = None
        self.ex: Executor | None = None
        self._meta: KVTierMetadata | None = None
        self.disabled = False                 # register_kv_caches failed: every load fails, nothing stored
        self._lost: set[str] = set()          # waiting requests failed without an executor: reported done
        self._capacity: dict[int, int] = {}   # reported once: the pool's size
        self.sending = SendingRequests(self.count, self._once)  # finished requests vLLM holds for stores

    # ---- counters ----------------------------------------------------------------------
    def count(self, key: str, v: float = 1) -> None:
        self.counters.count(key, v)

    @property
    def totals(self) -> dict[str, float]:
        return self.counters.totals

    def take_interval_stats(self) -> KVTierStats | None:
        return interval_stats(self.counters)

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
            self.ex.finish_loads()
            self.pending.drain(SHUTDOWN_FLUSH_TIMEOUT_S)
            self.layout = lay
            self.kv = KVCopier(lay, self.pools[0], self._copy_streams, self.count)
            self.ex.bind(self.kv)
            log.info("kvtier worker: KV re-registered (%s); cpu pool kept, %d slots", lay.describe(),
                     self.pools[0].num_slots)
            return
        if self._parts_of is not None:
            self.parts, self._pieces = self._parts_of(lay)
        else:
            r = self.store_rank
            self.parts = Parts(count=max(r + 1, self._ranks), writers=self._ranks, part_bytes=lay.block_bytes,
                               held=(r, r + 1), writes=r == self.rank, why="one part per rank")
            self._pieces = [[(0, lay.block_bytes)]]
        self.layout = lay
        n, warning = fit_pool_slots(self._cpu_tier, lay.block_bytes, self._ranks)
        if warning:
            log.warning("%s", warning)
            self.count(Metric.CPU_POOL_SHRUNK.key, 1)
        self._capacity = {0: n}   # the scheduler's tier follows (the first report)
        pool = CpuPool(n, lay.block_bytes, self._pin)
        self.pools = [pool]
        self.kv = KVCopier(lay, pool, self._copy_streams, self.count)
        self.ex = Executor(self.kv, [pool], lay.block_bytes, tier_names=self._tier_names, write_lag_steps=self._lag,
                           rank=self.rank,
                           staging=Staging(lay.block_bytes, self._pin), report_cls=KVTierWorkerMeta,
                           count=self.counters.count)
        self.pending = PendingStores(self.ex)   # stores whose device copies are still running
        log.debug("kvtier worker: %s; cpu pool %d slots", lay.describe(), n)
        if self._shared_fn is not None and self.shared is None and not self._shared_needs_identity:
            self._open_shared()

    def _held(self, open_part) -> Any:
        """The data plane of the parts this worker holds: `open_part(part, bytes, of)` each, under
        one `PartsPlane` unless it is one part that is the whole row."""
        lo, hi = self.parts.held
        planes = []
        try:
            for j, p in enumerate(range(lo, hi)):
                planes.append(open_part(p, sum(n for _, n in self._pieces[j]), hi - lo))
        except BaseException:
            for pl in planes:
                pl.close()
            raise
        if len(planes) == 1 and self._pieces[0] == [(0, self.layout.block_bytes)]:
            return planes[0]
        return PartsPlane(planes, self._pieces, self.layout.block_bytes)

    def _open_shared(self, model: str | None = None) -> None:
        self.shared = shared = self._held(lambda p, nbytes, of: self._shared_fn(nbytes, self.count, model, p, of))
        why = shared.ping()
        if why:
            log.warning("kvtier worker: shared tier %s not reachable now (%s): misses until it answers",
                        self.shared.s.where, why)

    def disable(self) -> None:
        """register_kv_caches failed: this worker loads nothing (load errors) and stores nothing."""
        self.disabled = True

    # ---- per step ----------------------------------------------------------------------
    def bind(self, meta: Any) -> None:
        self._meta = meta = meta if isinstance(meta, KVTierMetadata) else None
        if meta is not None and meta.sending:   # consumed: a second bind of the metadata holds nothing twice
            sending, meta.sending = meta.sending, {}
            self.sending.add(sending)
        if meta is not None and meta.settle:    # a step vLLM ran without `handle_preemptions` (no forward)
            self.handle_preemptions(meta)
        if meta is None or self.ex is None:
            return
        ex = self.ex
        ex.begin_step()   # a new step: its stores are tainted only by its own failed loads
        if meta.tier_names:
            ex.bind(tier_names=meta.tier_names)
        n = max(len(meta.tier_names or ()), 1 + max([i for i in (meta.shared_tier, meta.nvme_tier) if i is not None],
                                                     default=0))
        ex.bind(ntiers=n)
        if meta.shared_tier is not None:
            if self.shared is None and self._shared_needs_identity and meta.model_identity and self.layout:
                self._open_shared(meta.model_identity)
            ex.bind(planes={meta.shared_tier: self.shared})
        if meta.nvme_tier is not None:
            self._open_nvme(meta)
            ex.bind(planes={meta.nvme_tier: self.nvme})

    def handle_preemptions(self, meta: Any) -> None:
        """Before vLLM reuses a block: every store still copying from a block the metadata names
        (`settle`: a preempted request's blocks, the blocks vLLM allocated this step) is waited for
        on the host, then reported (`PendingStores.settle`). vLLM calls it before the step's forward
        and before any connector's loads (its offloading worker flushes there too); `bind` calls it
        for a step that skipped it. Consumed: a second call waits for nothing."""
        if not isinstance(meta, KVTierMetadata) or not meta.settle:
            return
        blocks, meta.settle = set(meta.settle), []
        if self.ex is not None:
            self.pending.settle(blocks)

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
        from kvtier.tiers.nvme_data import NvmeData
        if self.nvme is not None:
            self.pending.drain(SHUTDOWN_FLUSH_TIMEOUT_S)
            self.ex.reap(wait=True)
            self.nvme.close()
            self.nvme = None
        io, threads, direct = self._nvme_args
        try:
            self.nvme = self._held(lambda p, nbytes, of: NvmeData(
                meta.nvme_dir, meta.nvme_capacity, nbytes, io, max(1, threads // of), direct, rank=p,
                sealer=self._nvme_sealer))
        except Exception as e:  # noqa: BLE001 - any failure to open is a tier unavailable, not a crash
            self._nvme_failed_at = now
            self.count(Metric.NVME_OPEN_FAILED.key)
            self._once(("nvme_open",) + cause(e), logging.ERROR,
                       "kvtier: NVMe data file under %s cannot be opened (%s); NVMe loads are recomputed and "
                       "writes dropped until it can (tried again every %.0f s)", meta.nvme_dir, e, NVME_REOPEN_S)
            return
        if self.nvme.gds is not None:   # io: kvikio: its mode on /metrics
            self.count(Metric.NVME_GDS.key, int(self.nvme.gds))
        if self._nvme_failed_at is not None:
            log.warning("kvtier: NVMe data file %s open again", self.nvme.path)
            self._nvme_failed_at = None

    def start_load(self) -> None:
        """This step's loads, before the forward: NVMe reads and checksums now, then copies into
        the KV (a GPU: layer by layer on a side stream, `wait_layer`; the CPU backend: now, NVMe
        chunks as they land). Requests vLLM loads asynchronously (`meta.async_loads`: a shared-tier
        hit) only start their reads; `poll_async` finishes them in a later step."""
        meta = self._meta
        if meta is None:
            return
        ex = self.ex
        if meta.failed_loads:  # loads the scheduler accepted but could not plan: vLLM recomputes them
            failed, meta.failed_loads = meta.failed_loads, {}
            later = set(meta.async_loads)
            if ex is None:
                self._lost.update(rid for rid in failed if rid in later)
            else:
                for rid, ids in failed.items():
                    ex.fail_blocks(rid, ids, "planning", waiting=rid in later)
        if not meta.loads:
            return
        if ex is None or self.disabled:
            self.fail_step_loads()
            return
        loads, meta.loads = meta.loads, []   # a second start_load_kv in the same step loads nothing twice
        later = set(meta.async_loads)
        if later:
            ex.load_async([op for op in loads if op.req_id in later])
            loads = [op for op in loads if op.req_id not in later]
        ex.load(loads, layered=True)

    def poll_async(self) -> set[str]:
        """Requests whose asynchronous loads arrived: their blocks go into the KV now (after the
        step's forward), and vLLM schedules them from the next step. In a step with nothing else to
        run (`meta.idle`) it waits for them (bounded): the waiting thread lets go of the GIL, which
        the reads need (an engine loop spinning through empty steps would starve them)."""
        if self.ex is None:
            return set(self._lost)
        idle = self._meta is not None and self._meta.idle
        return self.ex.poll_async(self.IDLE_WAIT_S if idle else 0.0) | self._lost

    def finished_sending(self) -> set[str]:
        """Held finished requests (`bind`) none of whose stores is still copying on this worker:
        each reported once (`SendingRequests`)."""
        if self.ex is None:
            return self.sending.take(set())
        self.pending.poll()
        return self.sending.take(self.pending.copying())

    def take_failed_recving(self) -> set[str]:
        """Requests `poll_async` / `fail_async` reported whose load failed, since the last call."""
        lost, self._lost = self._lost, set()
        return lost | (self.ex.take_failed_recving() if self.ex is not None else set())

    def wait_layer(self, layer_name: str) -> None:
        """The forward is about to run `layer_name`'s attention: its blocks must be in place (the
        compute stream waits for the layer's copies). A wait that fails falls back to the host
        waiting for every copy of the step (`settle_loads`); never an early return."""
        ex = self.ex
        if ex is None or not ex.loads_pending:
            return
        try:
            fault_point("layer_wait")
            events = ex.layer_events
            if events is not None:
                li = self.layout.layer_of.get(layer_name)
                self.kv.wait_layer(events[-1] if li is None else events[li])
        except Exception as e:  # noqa: BLE001 - the host waits instead
            self.count(Metric.LAYER_WAIT_FAILED.key)
            self._once(("layer_wait",) + cause(e), logging.ERROR, "kvtier: the forward's wait for %s's loaded "
                       "blocks failed (%s): the host waits for the step's copies instead; any it cannot confirm "
                       "are load errors", layer_name, e)
            self.settle_loads()

    def settle_loads(self) -> None:
        """The host waits for every load copy of the step and accounts them; a copy that failed or
        cannot be confirmed makes its blocks load errors (vLLM recomputes them; the step's stores
        are dropped). Afterwards no layer waits: everything is in place."""
        ex = self.ex
        if ex is None:
            return
        try:
            ex.finish_loads()
        except Exception as e:  # noqa: BLE001 - cannot confirm: fail the loads rather than trust them
            self._once(("settle",) + cause(e), logging.ERROR, "kvtier: the step's load copies cannot be "
                       "confirmed (%s): their blocks are load errors", e)
            ex.abandon_loads()

    def finish_loads(self) -> None:
        if self.ex is not None:
            self.ex.finish_loads()

    def save(self) -> None:
        """After the forward: GPU -> CPU stores, then the copies down (written behind). A load of
        this step that failed taints the step: vLLM recomputes those blocks, but this forward
        already computed the blocks after them over their stale contents, so nothing of it is
        stored. On a GPU nothing here waits on the host: the stores' copies are left running
        (`PendingStores`: reported, and their copies down started, once a later poll sees their
        event complete) and the loads are accounted as queued."""
        if self.ex is not None:
            self.ex.finish_loads(wait=False)
            self.pending.poll()
        meta = self._meta
        if meta is None or not (meta.stores or meta.copies):
            return
        if self.ex is None or self.disabled:
            self.fail_step_stores()
            return
        tainted = self.ex.tainted
        if tainted and meta.stores:
            self._once(("tainted",), logging.WARNING, "kvtier: a load failed this step: its %d stores are "
                       "dropped (computed over blocks vLLM recomputes)", len(meta.stores))
        stores, meta.stores = meta.stores, []
        copies, meta.copies = meta.copies, []
        if not self.parts.writes:  # another rank writes the same bytes to the file / shared tier
            copies = [op for op in copies if op.tier not in (meta.nvme_tier, meta.shared_tier)]
        failed = self.ex.store(stores, tainted, defer=True)
        self.pending.add(self.ex.take_deferred())
        if not self.pending.hold(copies, failed):
            self.ex.copy(copies, failed)
        self.pending.poll()

    # ---- the report --------------------------------------------------------------------
    @property
    def loads_in_flight(self) -> int:
        return self.ex.loads_in_flight if self.ex is not None else 0

    @property
    def writes_in_flight(self) -> int:
        return self.ex.writes_in_flight if self.ex is not None else 0

    def take_report(self, finish: bool = True) -> KVTierWorkerMeta | None:
        """This step's report (once per step): loads, stores, copies now durable; the pool's size
        in the first one. `finish=False` (recovering from a failure): the report as it stands."""
        if self.ex is None:
            return None
        if finish:
            self.ex.finish_loads(wait=False)
            self.pending.poll()
        if self._capacity:
            self.ex.report.capacity(self._capacity)
            self._capacity = {}
        return self.ex.step() if finish else self.ex.take_report()

    def take_load_errors(self, finish: bool = True) -> set[int]:
        if self.ex is None:
            return set()
        if finish:
            self.ex.finish_loads(wait=False)
        return self.ex.take_load_errors(False)

    # ---- failures: a failed hook's safe answer (`connector.hook`): the step's loads fail as load
    # errors, its stores are dropped, a request waiting for its load or held for its stores is never kept
    def register_failed(self, kv_caches: dict) -> None:
        log.error("kvtier: worker rank %s runs without kvtier: every planned load is recomputed, "
                  "nothing is stored", self.rank)
        self.disable()

    def load_failed(self, *args: Any, **kwargs: Any) -> None:
        self.fail_step_loads()

    def layer_wait_failed(self, layer_name: str) -> None:
        self.settle_loads()   # never an early return: the host waits, or the loads fail

    def preemptions_failed(self, meta: Any) -> None:
        """Stores that may read reused blocks cannot be confirmed: every one still copying is
        dropped, never committed."""
        if self.ex is not None:
            self.pending.drain(0.0, "handle_preemptions failed")

    def save_failed(self) -> None:
        self.fail_step_stores()

    def transfers_failed(self, finished_req_ids: set[str]) -> Any:
        """Every waiting load failed (the connector keeps `failed_recving` for a hybrid model only)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
        failed = self.fail_async()
        sent = self.sending.take_all()   # never held forever
        return KVConnectorTransferResults(finished_recving=set(failed), finished_sending=sent,
                                          failed_recving=set(failed))

    def load_errors_failed(self) -> set[int]:
        return self.take_load_errors(finish=False)

    def worker_meta_failed(self) -> KVTierWorkerMeta | None:
        return self.take_report(finish=False)

    def fail_step_loads(self) -> None:
        meta = self._meta
        if meta is None:
            return
        ops, meta.loads = list(meta.loads), []
        if self.ex is None:  # nothing to fail the blocks with: a waiting request is still reported
            self._lost.update(meta.async_loads)
            return
        self.ex.fail_loads_of(ops, "the step's loads failed", async_ids=meta.async_loads)

    def fail_async(self) -> set[str]:
        lost, self._lost = self._lost, set()
        return (self.ex.fail_async() if self.ex is not None else set()) | lost

    def fail_step_stores(self) -> None:
        meta = self._meta
        if meta is None or self.ex is None:
            return
        stores, copies = meta.stores, meta.copies
        meta.stores, meta.copies = [], []
        self.ex.fail_stores(stores, copies)

    # ---- introspection and shutdown -------------------------------------------------------
    @property
    def corrupt_blocks(self) -> int:
        return self.ex.corrupt_blocks if self.ex is not None else 0

    def stats(self) -> dict:
        return {"totals": dict(self.totals), "layout": self.layout.describe() if self.layout else None,
                "pools": [{"slots": p.num_slots, "pinned": p.pinned} for p in self.pools],
                "nvme": {"path": self.nvme.path, "engine": self.nvme.description} if self.nvme else None,
                "corrupt_blocks": self.corrupt_blocks}

    def close(self, timeout_s: float | None = None) -> KVTierWorkerMeta | None:
        """Shut down: finish loads, wait up to `timeout_s` (default `SHUTDOWN_FLUSH_TIMEOUT_S`) for
        the pending write-back, free the memory. Returns the report no step carried yet (copies
        made durable since the last step, for the scheduler to commit), or None."""
        ex = self.ex
        if ex is None:
            return None
        limit = SHUTDOWN_FLUSH_TIMEOUT_S if timeout_s is None else timeout_s
        t0 = time.monotonic()
        copying = self.pending.drain(limit)   # stores still copying: their copies down start now
        pending = ex.file_writes_in_flight
        late, late_puts = ex.drain(max(0.0, limit - (time.monotonic() - t0)))
        if late_puts:
            log.warning("kvtier: shutdown: %d shared-tier write batches still running; left behind", late_puts)
        final = ex.take_report()
        if pending:
            n = sum(1 for v in (final.copied.values() if final else ()) for c in v if c != -1)
            if late:
                log.error("kvtier: shutdown: %d of %d NVMe write batches still running after %.1f s; "
                          "left behind (their blocks are not indexed)", late, pending, limit)
            log.info("kvtier: shutdown: NVMe write-back flushed, %d blocks in %d batches in %.2f s",
                     n, pending - late, time.monotonic() - t0)
            if n:  # durable on disk; indexed only if the scheduler gets this report
                self.count(Metric.NVME_UNREPORTED_BLOCKS.key, n)
        ex.close(wait=not (late or late_puts))
        if late or late_puts or copying:  # a write still reads the CPU pool (a copy writes it): leave them
            return final
        for plane in (self.nvme, self.shared, ex.staging):
            if plane is not None:
                plane.close()
        self.nvme = self.shared = None
        ex.staging = None
        self.kv = None
        for p in self.pools:
            p.close()
        self.pools = []
        return final


# ---- finished requests held for their stores, the worker's side ---------------------------------------
class SendingRequests:
    """Worker side: the held requests the metadata named, until this worker reports each once."""

    def __init__(self, count: Any, once: Any) -> None:
        self.count, self.once = count, once
        self.limit_s = HOLD_LIMIT_S
        self.held: dict[str, tuple[frozenset, float]] = {}

    def add(self, sending: dict[str, list[int]]) -> None:
        now = time.monotonic()
        for rid, ops in sending.items():
            self.held.setdefault(rid, (frozenset(ops), now))

    def take(self, copying: set[int]) -> set[str]:
        """Held requests none of whose stores is `copying` (op ids still copying here), or held
        longer than `limit_s`: reported once, forgotten."""
        now = time.monotonic()
        out: set[str] = set()
        late = 0
        for rid, (ops, t0) in self.held.items():
            if not ops & copying:
                out.add(rid)
            elif now - t0 >= self.limit_s:
                out.add(rid)
                late += 1
        for rid in out:
            del self.held[rid]
        if late:
            self.count(Metric.HELD_RELEASE_TIMEOUTS.key, late)
            self.once(("held_timeout",), logging.ERROR, "kvtier: %d finished requests released after %.0f s with "
                      "their stores still copying (a block vLLM hands out again is waited for before its reuse)",
                      late, self.limit_s)
        return out

    def take_all(self) -> set[str]:
        """Every held request (a failed hook's safe answer: never held forever)."""
        out = set(self.held)
        self.held.clear()
        return out


# ---- stores whose device copies are still running, reported in a later step ---------------------------
# `wait_for_save` queues a step's GPU -> CPU copies on the side stream and returns (no host wait;
# the compute stream does not wait either: the blocks they read are not reused meanwhile, `settle`).
# Each step's hooks poll the oldest stores' events (`Streams.query`); once one completed, its
# stores are reported stored (the scheduler commits them from that step's report) and the copies
# down held behind it (NVMe writes with their checksums, shared-tier puts: they read the CPU slots)
# start. A store whose event reports an error is not stored and its copies down are dropped, so
# nothing of it is committed. At shutdown `drain` waits (bounded) and drops what is left, counted.


@dataclass
class _Pending:
    planned: list                      # (StoreOp, job) pairs whose copies the event covers
    event: Any
    t0: float
    copies: list = field(default_factory=list)     # copies down that read these slots: start after
    failed: set = field(default_factory=set)       # (tier, slot) whose store failed in their step


class PendingStores:
    """Oldest first; the side stream runs them in order, so only a completed prefix is reported."""

    def __init__(self, ex: Any) -> None:
        self.ex = ex
        self.q: list[_Pending] = []

    def __len__(self) -> int:
        return len(self.q)

    def add(self, deferred: tuple | None) -> None:
        """The executor's last deferred store (`Executor.take_deferred`), if any."""
        if deferred is not None:
            self.q.append(_Pending(*deferred))

    def copying(self) -> set[int]:
        """Op ids of the stores still copying."""
        return {op.op_id for p in self.q for op, _ in p.planned}

    def hold(self, copies: list, failed: set) -> bool:
        """Copies down of this step: held behind the newest pending store (they may read its
        slots); False when nothing is pending (they may start now)."""
        if not self.q:
            return False
        self.q[-1].copies.extend(copies)
        self.q[-1].failed |= failed
        return True

    def poll(self) -> int:
        """Report the stores whose copies completed (oldest first); returns how many remain."""
        ex = self.ex
        while self.q:
            p = self.q[0]
            try:
                if not ex.outside.done(p.event):
                    break
            except Exception as e:  # noqa: BLE001 - the copies failed: nothing of them is committed
                self.q.pop(0)
                ex.count(Metric.STORE_COPY_FAILED.key, len(p.planned))
                ex.once(("store_event",) + cause(e), logging.ERROR, "kvtier: a store's device copies failed (%s): "
                        "not stored, its copies down dropped", e)
                ex.copy(p.copies, p.failed | ex.store_lost(p.planned, e))
                continue
            self.q.pop(0)
            ex.store_done(p.planned, time.perf_counter() - p.t0)
            ex.copy(p.copies, p.failed)
        return len(self.q)

    def settle(self, blocks: set[int]) -> int:
        """The host waits for the pending stores that read any of `blocks` (vLLM may rewrite them
        from now on), and for those before them (the side stream runs in order), then reports
        them; returns how many. A wait that fails drops them: not stored, their copies down
        dropped, counted (`stores_dropped`)."""
        last = -1
        for i, p in enumerate(self.q):
            if any(not blocks.isdisjoint(op.block_ids) for op, _ in p.planned):
                last = i
        if last < 0:
            return 0
        ex = self.ex
        ex.count(Metric.STORE_SETTLE_WAITS.key)
        try:
            ex.outside.sync(self.q[last].event)
        except Exception as e:  # noqa: BLE001 - cannot confirm the copies: nothing of them is committed
            late, self.q = self.q[:last + 1], self.q[last + 1:]
            ex.count(Metric.STORES_DROPPED.key, sum(len(op.slots) for p in late for op, _ in p.planned))
            ex.once(("store_settle",) + cause(e), logging.ERROR, "kvtier: waiting for the stores of blocks vLLM "
                    "reuses failed (%s): not stored, their copies down dropped", e)
            for p in late:
                ex.copy(p.copies, p.failed | ex.store_lost(p.planned, e))
            return last + 1
        self.poll()
        return last + 1

    def drain(self, timeout_s: float, why: str = "closing") -> int:
        """Wait up to `timeout_s` for every pending store (polling); those still running are
        dropped (not stored, their copies down not started) and counted; returns how many."""
        deadline = time.monotonic() + timeout_s
        while self.poll() and time.monotonic() < deadline:
            time.sleep(0.001)
        if not self.q:
            return 0
        ex, late, self.q = self.ex, self.q, []
        n = sum(len(op.slots) for p in late for op, _ in p.planned)
        ex.count(Metric.STORES_DROPPED.key, n)
        log.error("kvtier: %d stores (%d blocks) still copying after %.1f s (%s): dropped, not stored",
                  len(late), n, timeout_s, why)
        for p in late:
            ex.store_lost(p.planned, RuntimeError(f"still copying ({why})"))
            ex.fail_stores([], p.copies)
        return len(late)
