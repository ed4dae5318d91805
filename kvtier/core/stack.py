"""TierStack: the controller plus a local executor, driven without vLLM (CLI, tests, benchmarks).

Every decision is the `TierController`'s (the same object the vLLM connector runs); this class
only turns synchronous calls into plan -> execute -> complete rounds. Public surface: lookup
(side-effect free), get / put (bytes in and out), flush, clear, and the lease API
plan / commit / release.
"""

from __future__ import annotations

import errno
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from kvtier.policies.base import RequestInfo, NO_INFO

from kvtier.core.builder import build_controller, build_tiers, fresh_evictions
from kvtier.core.config import StackConfig, load_config
from kvtier.core.controller import TierController
from kvtier.core.executor import Executor
from kvtier.core.outside import Buffers
from kvtier.core.ledger import Lease
from kvtier.core.plan import Plan, Report
from kvtier.common.counters import Metric

log = logging.getLogger("kvtier.startup")


_PER_TIER = {"hits": Metric.HIT_BLOCKS, "stored": Metric.STORED_BLOCKS, "not_admitted": Metric.NOT_ADMITTED_BLOCKS,
             "dropped_full": Metric.STORE_DROPPED_BLOCKS, "evicted": Metric.EVICTED_BLOCKS,
             "demoted": Metric.DEMOTED_BLOCKS, "promoted": Metric.PROMOTED_BLOCKS, "corrupt": Metric.CORRUPT_BLOCKS,
             "bytes_read": Metric.BYTES_LOADED, "bytes_written": Metric.BYTES_STORED}


@dataclass
class StackMetrics:
    """Per-tier counters keyed by tier name (a view of the controller's counters)."""

    lookups: int = 0
    misses: int = 0
    per_tier: dict[str, dict[str, int]] = field(default_factory=dict)

    @classmethod
    def of(cls, totals: dict[str, float]) -> "StackMetrics":
        m = cls(lookups=int(totals.get(Metric.N_LOOKUPS.key, 0)), misses=int(totals.get(Metric.MISS_BLOCKS.key, 0)))
        for attr, key in _PER_TIER.items():
            pre = key.at("")
            m.per_tier[attr] = {k[len(pre):]: int(v) for k, v in totals.items() if k.startswith(pre) and v}
        return m

    def __getattr__(self, name: str) -> dict[str, int]:
        try:
            return self.__dict__["per_tier"][name]
        except KeyError:
            raise AttributeError(name) from None

    def as_dict(self) -> dict:
        return {"lookups": self.lookups, "misses": self.misses, **self.per_tier}


class TierStack:
    def __init__(self, cfg: StackConfig, tiers: Sequence[Any], with_data: bool = True,
                 lease_timeout_s: float = 60.0) -> None:
        self.cfg = cfg
        self.tiers = list(tiers)
        self.with_data = with_data
        self.block_bytes = cfg.block_bytes
        self.ctrl: TierController = build_controller(cfg, self.tiers, lease_timeout_s=lease_timeout_s)
        self.executor = (Executor(Buffers([], cfg.block_bytes), [t.data_plane for t in self.tiers], cfg.block_bytes,
                                  tier_names=[t.name for t in self.tiers], count=self.ctrl.counters.count)
                         if with_data else NullExecutor())
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, cfg: StackConfig | str | None = None, with_data: bool = True,
                    fingerprint: dict | None = None, **kw: Any) -> "TierStack":
        if not isinstance(cfg, StackConfig):
            cfg = load_config(cfg)
        stack = cls(cfg, build_tiers(cfg, "full" if with_data else "none", fingerprint), with_data, **kw)
        log.info("%s", stack.startup_line())
        return stack

    def startup_line(self) -> str:
        """Tiers and capacities, I/O engines, data directories, blocks restored, policies, fingerprint."""
        from kvtier.tiers.nvme_control import fingerprint_hash
        fp = self.cfg.fingerprint()
        return (f"kvtier stack opened: {'; '.join(t.summary() for t in self.tiers)}; policies {self.ctrl.describe()}; "
                f"{'real bytes' if self.with_data else 'metadata only'}; fingerprint {fingerprint_hash(fp)}; "
                f"config {self.cfg.source}")

    @property
    def leases(self):
        return self.ctrl.leases

    @property
    def metrics(self) -> StackMetrics:
        return StackMetrics.of(self.ctrl.totals)

    # ---- lookups and leases ----------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> int:
        """Length of the prefix of `keys` present in some tier. No side effects."""
        return self.ctrl.lookup(keys)

    def plan(self, request_id: str, keys: Sequence[bytes], start: int = 0) -> Lease:
        """Pin the present prefix of keys[start:] under a lease (idempotent per range); a lease
        of no blocks when nothing is present."""
        lease = self.ctrl.acquire(request_id, keys[start:], start)
        return lease if lease is not None else Lease(request_id, start, tuple(keys[start:]), [], 0.0)

    def commit(self, request_id: str, num_blocks: int) -> Lease | None:
        return self.ctrl.leases.commit(request_id, num_blocks)

    def release(self, request_id: str) -> int:
        return self.ctrl.release(request_id)

    abort = release

    # ---- plan -> execute -> complete -----------------------------------------------------
    def _run(self, dsts=None, srcs=None) -> dict[int, bool]:
        """Execute the controller's plan and complete it. A failed write is loud: the controller
        has kept the block where it was (not indexed below), and this raises OSError (EIO)."""
        plan = self.ctrl.take_plan()
        if plan.is_empty():
            return {}
        blocks = dsts if dsts is not None else (srcs if srcs is not None else [])
        rep, loaded = self.execute(plan, blocks)
        self.ctrl.take_errors()   # only this plan's failures make this call fail
        self.ctrl.complete(rep)
        if errors := self.ctrl.take_errors():
            raise OSError(errno.EIO, "; ".join(errors[:2] + self.executor.errors[:1]))
        return loaded

    def execute(self, plan: Plan, blocks: Sequence[torch.Tensor]) -> tuple[Any, dict[int, bool]]:
        """Run a plan with the caller's `blocks` (block id -> tensor) as the outside: the report,
        and per loaded block id whether its bytes arrived."""
        ex = self.executor
        if self.with_data:
            ex.bind(Buffers(blocks, self.block_bytes))
        ex.take_errors()   # the engine's words for this plan only
        rep = ex.run(plan)
        bad = ex.take_load_errors()
        return rep, {b: b not in bad for op in plan.loads for b in op.block_ids}

    def get(self, keys: Sequence[bytes], dsts: Sequence[torch.Tensor] | None = None,
            info: RequestInfo = NO_INFO) -> int:
        """Serve the present prefix of `keys` into `dsts`; returns blocks served. A block that
        fails verification ends the prefix there. Promotion as the policy says."""
        rid = f"get-{next(self._ids)}"
        lease = self.ctrl.acquire(rid, keys)
        n = lease.num_blocks if lease is not None else 0
        if n:
            self.ctrl.load(rid, n, list(range(n)), info)
            loaded = self._run(dsts)
            if self.with_data and dsts is not None:
                n = next((i for i in range(n) if not loaded.get(i, False)), n)
            self.ctrl.release(rid)
        self.ctrl.count_request(len(keys), n)
        return n

    def put(self, keys: Sequence[bytes], srcs: Sequence[torch.Tensor] | None = None,
            info: RequestInfo = NO_INFO) -> int:
        """Store blocks into the top tier (rounds until every admitted block found room);
        returns blocks stored."""
        if self.with_data and srcs is None:
            raise ValueError("put without data on a stack built with data")
        top = Metric.STORED_BLOCKS.at(self.tiers[0].name)
        before = self.ctrl.total(top)
        todo = list(range(len(keys)))
        admit = True
        while todo:
            planned, _, deferred = self.ctrl.store([keys[i] for i in todo], todo, info, admit=admit, retry=True)
            admit = False  # admission decides once per block
            moved = self.ctrl.has_plan()
            self._run(None, srcs)
            todo = [todo[j] for j in deferred]
            if not planned and not moved:
                self.ctrl.count_dropped(0, len(todo))
                break  # nothing fits now (every block pinned)
        return int(self.ctrl.total(top) - before)

    def flush(self, ti: int = 0, batch: int = 256, progress=None) -> int:
        """Copy every resident block of tier `ti` that the next tier lacks down to it (kept above)."""
        if ti + 1 >= len(self.tiers):
            return 0
        key = Metric.DEMOTED_BLOCKS.at(self.tiers[ti + 1].name)
        before = self.ctrl.total(key)
        self.ctrl.flush(ti, batch)
        for op in self.ctrl.take_plan().copies:  # one batch at a time, for the progress bar
            rep = self.executor.run(Plan(copies=[op]))
            self.ctrl.complete(rep)
            if progress:
                progress(len(op.slots))
        return int(self.ctrl.total(key) - before)

    def clear(self) -> int:
        """Drop every resident block of every tier (a persistent tier's index too) and start each
        eviction policy afresh; nothing may be leased. Returns the blocks dropped."""
        return self.ctrl.clear(fresh_evictions(self.cfg, self.tiers))

    # ---- introspection ---------------------------------------------------------------------
    def stats(self) -> dict:
        return {"block_bytes": self.block_bytes, "tiers": [t.stats() for t in self.tiers],
                "policies": self.ctrl.describe(), "leases": len(self.ctrl.leases),
                "metrics": self.metrics.as_dict()}

    def close(self) -> None:
        self.ctrl.close()  # lower tiers first: their in-flight writes read upper tiers' memory

    def __enter__(self) -> "TierStack":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class NullExecutor:
    """Moves nothing and reports every op done (replay and simulation without data)."""

    errors: list[str] = []

    def take_errors(self) -> list[str]:
        return []

    def run(self, plan: Plan) -> Report:
        return Report.of_plan(plan, ok=True)

    def take_load_errors(self, finish: bool = True) -> set[int]:
        return set()
