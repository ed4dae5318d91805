"""`KvtierNvmeTier`: kvtier's NVMe tier (`tiers.nvme.NvmeTier`) as a vLLM secondary tier.

    {"type": "KvtierNvmeTier", "module_path": "kvtier.vllm", "path": "/mnt/nvme/kv", "capacity": "200GiB"}

A chunk of vLLM's CPU primary tier is one kvtier block under vLLM's offload key, sealed with a
header keyed by the directory's secret that names the key and the fingerprint (model weights,
dtype, layout, chunk geometry). The same write order as the connector's: the bytes go through
the tier's data plane (its I/O engine's threads), an fdatasync on this tier's flusher thread,
then the index commit in `get_finished_jobs` (the scheduler thread, as the connector's scheduler
commits its index: one LMDB transaction for every store that finished since the last call), so
the index never names unwritten bytes and a restart serves every committed chunk. A read verifies key, fingerprint
and payload: a chunk that fails is a failed load (vLLM recomputes it), quarantined (the next
lookup misses) and counted. No data I/O runs on the scheduler thread.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import LookupResult, Medium, OffloadKey, ReqContext
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob

from kvtier.tiers.io_engine import IOHandle, IOResult
from kvtier.common.counters import Metric

from .common import KvtierSecondaryTier


@dataclass
class _Store:
    job_id: int
    keys: list[OffloadKey]
    slots: list[int]
    done: Future
    t0: float = field(default_factory=time.monotonic)


@dataclass
class _Load:
    job_id: int
    keys: list[OffloadKey]          # the job's keys, in order
    slots: list[int]                # the slots read (keys found at submit)
    found: list[OffloadKey]         # their keys
    handle: IOHandle | None
    t0: float = field(default_factory=time.monotonic)


class KvtierNvmeTier(KvtierSecondaryTier):
    """kvtier's trusted NVMe tier below vLLM's CPU primary tier (see the module docstring)."""

    medium: ClassVar[Medium] = Medium.STORAGE
    kind = "nvme"

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str, **options: Any) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, **options)
        self.data = self.tier.data_plane
        self._flusher = ThreadPoolExecutor(1, thread_name_prefix="kvtier-nvme-flush")
        self._stores: dict[int, _Store] = {}
        self._loads: dict[int, _Load] = {}
        self._storing: dict[OffloadKey, int] = {}   # key -> stores in flight carrying it

    # ---- lookups ------------------------------------------------------------------------
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if self.tier.find(key) is not None:
            return LookupResult.HIT
        return LookupResult.RETRY if key in self._storing else LookupResult.MISS

    def touch(self, keys, req_context: ReqContext) -> None:
        slots = [s for s in (self.tier.find(k) for k in keys) if s is not None]
        if slots:
            self.tier.hit(slots)

    # ---- stores: allocate here, bytes on the engine's threads, fdatasync on the flusher -----
    def submit_store(self, job_metadata: TransferJob) -> None:
        job_id = job_metadata.job_id
        try:
            keys, chunks = self._new_keys(job_metadata)
            slots = self._allocate(keys)
            keys, chunks = keys[:len(slots)], chunks[:len(slots)]
        except Exception as e:  # noqa: BLE001 - a hook never raises into vLLM
            self.failed("store", e)
            self.finish(job_id, False)
            return
        if not slots:
            self.finish(job_id, True)
            return
        try:
            handle = self.data.write(slots, self.rows(chunks), keys)
        except Exception as e:  # noqa: BLE001
            self.tier.abort(slots)
            self.failed("store", e)
            self.finish(job_id, False)
            return
        for k in keys:
            self._storing[k] = self._storing.get(k, 0) + 1
        self._stores[job_id] = _Store(job_id, keys, slots, self._flusher.submit(self._flush, handle))

    def _new_keys(self, job: TransferJob) -> tuple[list[OffloadKey], list[int]]:
        """The job's keys not resident nor being stored, with their primary chunks."""
        keys, chunks, seen = [], [], set()
        for k, c in zip(job.keys, job.chunk_ids):
            if k in seen or k in self._storing or self.tier.find(k) is not None:
                continue
            seen.add(k)
            keys.append(k)
            chunks.append(int(c))
        return keys, chunks

    def _allocate(self, keys: list[OffloadKey]) -> list[int]:
        """Slots for as many of `keys` as fit once unpinned chunks are evicted (eviction policy
        order); the rest are skipped and counted."""
        tier = self.tier
        need = len(keys) - tier.num_free_slots
        if need > 0:
            victims = tier.free_slots(need)
            if victims:
                tier.evict(victims)
                self.count(Metric.EVICTED, len(victims))
        n = min(len(keys), tier.num_free_slots)
        if n < len(keys):
            self.count(Metric.STORE_SKIPPED_FULL, len(keys) - n)
        return tier.allocate(keys[:n]) if n else []

    def _flush(self, handle: IOHandle) -> IOResult:
        r = handle.wait()
        if any(r.ok):
            try:
                self.data.sync()
            except OSError as e:
                return IOResult(ok=[False] * len(r.ok), nbytes=0, errors=[f"fdatasync: {e}"])
        return r

    def _finish_stores(self, done: list[_Store]) -> None:
        """Index the chunks of every store that finished, in one transaction (one fsync a step)."""
        slots, sums, good_of = [], [], {}
        for st in done:
            for k in st.keys:
                n = self._storing.get(k, 0) - 1
                if n > 0:
                    self._storing[k] = n
                else:
                    self._storing.pop(k, None)
            try:
                r = st.done.result()
            except Exception as e:  # noqa: BLE001
                r = IOResult(ok=[False] * len(st.slots), errors=[str(e)])
            bad = [s for s, ok in zip(st.slots, r.ok) if not ok]
            if bad:
                self.tier.abort(bad)
                self.count(Metric.WRITE_ERRORS, len(bad))
                self._once(("write",), logging.ERROR, "kvtier: secondary tier %s: %d chunks not written (%s); they "
                           "stay in the primary tier only", self.tier_type, len(bad), r.errors[:2])
            good = [(s, c) for s, c, ok in zip(st.slots, r.tags or [-1] * len(st.slots), r.ok) if ok]
            slots += [s for s, _ in good]
            sums += [c for _, c in good]
            good_of[st.job_id] = (not bad, r.nbytes)
        committed = True
        if slots:
            try:
                self.tier.commit_written(slots, sums)
            except Exception as e:  # noqa: BLE001 - an index write failed: nothing indexed
                self.tier.abort(slots)
                self.failed("index_commit", e)
                committed = False
        for st in done:
            ok, nbytes = good_of[st.job_id]
            self.finish(st.job_id, ok and committed, t0=st.t0, nbytes=nbytes)

    # ---- loads: verified reads straight into the primary tier's chunks ----------------------
    def submit_load(self, job_metadata: TransferJob) -> None:
        job_id = job_metadata.job_id
        keys = list(job_metadata.keys)
        try:
            slots, found, chunks = [], [], []
            for k, c in zip(keys, job_metadata.chunk_ids):
                s = self.tier.find(k)
                if s is None:
                    self.count(Metric.LOAD_MISSES)   # evicted or quarantined since its lookup
                    continue
                slots.append(s)
                found.append(k)
                chunks.append(int(c))
            self.tier.touch(slots)
        except Exception as e:  # noqa: BLE001
            self.failed("load", e)
            self.finish(job_id, False)
            return
        handle = None
        if slots:
            try:
                handle = self.data.read(slots, self.rows(chunks), found, self.tier.checksums(slots))
            except Exception as e:  # noqa: BLE001
                self.tier.free_blocks(slots)
                self.failed("load", e)
                self.finish(job_id, False)
                return
        self._loads[job_id] = _Load(job_id, keys, slots, found, handle)

    def _finish_load(self, ld: _Load) -> None:
        try:
            r = ld.handle.wait() if ld.handle is not None else IOResult(ok=[])
        except Exception as e:  # noqa: BLE001
            r = IOResult(ok=[False] * len(ld.slots), errors=[str(e)])
        bad = r.bad or [False] * len(ld.slots)
        corrupt = [s for s, b in zip(ld.slots, bad) if b]
        if corrupt:   # quarantined while pinned: freed when the pins below are released
            self.tier.quarantine(corrupt, r.errors[0] if r.errors else "failed verification")
            self.count(Metric.CORRUPT_CHUNKS, len(corrupt))
            self._once(("corrupt",), logging.ERROR, "kvtier: secondary tier %s: %d chunks failed verification "
                       "(not served, quarantined): %s", self.tier_type, len(corrupt), r.errors[:2])
        self.count(Metric.READ_ERRORS, sum(1 for ok, b in zip(r.ok, bad) if not ok and not b))
        good = [k for k, ok in zip(ld.found, r.ok) if ok]
        self.tier.free_blocks(ld.slots)
        if good:
            self.tier.hit([s for s, ok in zip(ld.slots, r.ok) if ok])
        ok = len(good) == len(ld.keys)
        self.finish(ld.job_id, ok, None if ok else good, t0=ld.t0, nbytes=r.nbytes)

    # ---- completion ---------------------------------------------------------------------
    def get_finished_jobs(self) -> list[JobResult]:
        done = [st for st in self._stores.values() if st.done.done()]
        for st in done:
            del self._stores[st.job_id]
        if done:
            try:
                self._finish_stores(done)
            except Exception as e:  # noqa: BLE001 - never into vLLM: the jobs fail
                self.failed("store", e)
                reported = {r.job_id for r in self._done}
                for st in done:
                    if st.job_id not in reported:
                        self.finish(st.job_id, False)
        for jid, ld in list(self._loads.items()):
            if ld.handle is None or ld.handle.done():
                del self._loads[jid]
                try:
                    self._finish_load(ld)
                except Exception as e:  # noqa: BLE001
                    self.failed("load", e)
                    self.finish(jid, False)
        return self.take_done()

    def has_pending_work(self) -> bool:
        return bool(self._stores or self._loads or self._done)

    def drain_jobs(self) -> None:
        for st in list(self._stores.values()):
            try:
                st.done.result()
            except Exception:  # noqa: BLE001 - reported by get_finished_jobs
                pass
        for ld in list(self._loads.values()):
            if ld.handle is not None:
                try:
                    ld.handle.wait()
                except Exception:  # noqa: BLE001
                    pass

    def shutdown(self) -> None:
        """Finish what is in flight (committing finished stores), then close the tier (index,
        data file, directory lock)."""
        try:
            self.drain_jobs()
            self.get_finished_jobs()
        finally:
            self._flusher.shutdown(wait=True)
            self.tier.close()
            self.release_primary()
