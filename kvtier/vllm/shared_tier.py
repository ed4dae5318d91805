"""`KvtierSharedTier`: kvtier's shared tier (`tiers.shared.SharedTier`: Redis / Valkey / Redis
Cluster) as a vLLM secondary tier, for a fleet of vLLM instances of one model.

    {"type": "KvtierSharedTier", "module_path": "kvtier.vllm", "url": "redis://cache:6379/0",
     "secret": "${KVTIER_SHARED_SECRET}"}

Keys live in the namespace of the fingerprint (model weights, dtype, layout, chunk geometry,
parallelism, `namespace`), so another model or deployment on the same server never finds them;
each value carries kvtier's keyed header, so a foreign, planted or corrupt value is a miss and a
counter: it is deleted on the server while the server still holds that value (`SharedData.drop_bad`),
and a key whose load failed is a miss from then on (until this instance stores it again), so a bad
value is never found again and again. The server owns eviction: a chunk found by a lookup
may be gone at load (a failed load, vLLM recomputes). Lookups gather a step's unknown keys and
ask the server in one round trip when the step ends (`shared_lookup`; RETRY until the answer is
in); transfers run on the tier's pipelines; a server that fails or stalls trips kvtier's breaker,
and while it is open every lookup is a MISS: never a hang.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import LookupResult, Medium, OffloadKey, ReqContext, ScheduleEndContext
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob

from kvtier.tiers.io_engine import IOHandle, IOResult
from kvtier.common.counters import Metric

from .common import KvtierSecondaryTier
from .shared_lookup import BatchedLookup

FAILED_MAX = 1 << 16    # keys whose load failed, remembered as misses (the oldest forgotten first)


@dataclass
class _Job:
    job_id: int
    keys: list[OffloadKey]
    handle: IOHandle
    load: bool
    t0: float = field(default_factory=time.monotonic)


class KvtierSharedTier(KvtierSecondaryTier):
    """kvtier's Redis / Valkey fleet tier below vLLM's CPU primary tier (see the module docstring)."""

    # the hits it serves come from another host: vLLM reports them as external
    medium: ClassVar[Medium | None] = None
    kind = "shared"

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str, **options: Any) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, **options)
        self._jobs: dict[int, _Job] = {}
        self._storing: set[OffloadKey] = set()
        self._failed: OrderedDict[OffloadKey, None] = OrderedDict()   # loads that failed: misses from now on
        self._lookups = BatchedLookup(self.tier, self.count)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        try:
            if self.tier.conn.breaker.down:
                self.count(Metric.LOOKUPS_SERVER_DOWN)
                return LookupResult.MISS
            if key in self._failed:
                return LookupResult.MISS
            found = self._lookups.ask(key)
        except Exception as e:  # noqa: BLE001
            self.failed("lookup", e)
            return LookupResult.MISS
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        try:
            self._lookups.flush()
        except Exception as e:  # noqa: BLE001
            self.failed("lookup", e)

    def touch(self, keys, req_context: ReqContext) -> None:
        self.tier.touch_keys(list(keys))

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys, chunks = [], []
        for k, c in zip(job_metadata.keys, job_metadata.chunk_ids):
            if k not in self._storing and not self.tier.holds(k):
                keys.append(k)
                chunks.append(int(c))
        self._submit(job_metadata.job_id, keys, chunks, load=False)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata.job_id, list(job_metadata.keys), [int(c) for c in job_metadata.chunk_ids],
                     load=True)

    def _submit(self, job_id: int, keys: list[OffloadKey], chunks: list[int], load: bool) -> None:
        what = "load" if load else "store"
        if not keys:
            self.finish(job_id, True)
            return
        try:
            bufs = self.rows(chunks)
            plane = self.tier.conn
            handle = plane.read((), bufs, keys) if load else plane.write((), bufs, keys)
        except Exception as e:  # noqa: BLE001
            self.failed(what, e)
            self.finish(job_id, False)
            return
        if not load:
            self._storing.update(keys)
        self._jobs[job_id] = _Job(job_id, keys, handle, load)

    def _finish(self, job: _Job) -> None:
        try:
            r = job.handle.wait()
        except Exception as e:  # noqa: BLE001
            r = IOResult(ok=[False] * len(job.keys), errors=[str(e)])
        good = [k for k, ok in zip(job.keys, r.ok) if ok]
        lost = [k for k, ok in zip(job.keys, r.ok) if not ok]
        if job.load:
            if lost:   # gone (the server evicted it), corrupt, foreign or unreachable: a miss from now on
                self.tier.note_gone(lost)
                self.count(Metric.LOAD_MISSES, len(lost))
                for k in lost:
                    self._failed[k] = None
                while len(self._failed) > FAILED_MAX:
                    self._failed.popitem(last=False)
            ok = not lost
            self.finish(job.job_id, ok, None if ok else good, t0=job.t0, nbytes=r.nbytes)
            return
        self._storing.difference_update(job.keys)
        self.tier.note_written(good)
        for k in good:   # this instance wrote it again: good bytes
            self._failed.pop(k, None)
        self._lookups.forget_miss(good)
        if lost:
            self.count(Metric.STORE_ERRORS, len(lost))
        self.finish(job.job_id, not lost, t0=job.t0, nbytes=r.nbytes)

    def get_finished_jobs(self) -> list[JobResult]:
        for jid, job in list(self._jobs.items()):
            if job.handle.done():
                del self._jobs[jid]
                try:
                    self._finish(job)
                except Exception as e:  # noqa: BLE001 - never into vLLM: the job fails
                    self.failed("load" if job.load else "store", e)
                    self.finish(jid, False)
        return self.take_done()

    def has_pending_work(self) -> bool:
        return bool(self._jobs or self._done)

    def drain_jobs(self) -> None:
        for job in list(self._jobs.values()):
            try:
                job.handle.wait()
            except Exception:  # noqa: BLE001 - reported by get_finished_jobs
                pass

    def shutdown(self) -> None:
        try:
            self.drain_jobs()
            self.get_finished_jobs()
        finally:
            self._lookups.close()
            self.tier.close()
            self.release_primary()

    def all_counters(self) -> dict[str, int]:
        """The adapter's counters and the tier's (bad_blocks, missing_blocks, unreachable, ...)."""
        return {**self.counters, **{f"server.{k}": int(v) for k, v in self.tier.conn.counters.items()}}
