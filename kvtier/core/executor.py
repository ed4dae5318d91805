"""Executors outside vLLM: they run a controller's plan and report back (`kvtier.core.plan.Report`).

- `LocalExecutor`: moves real bytes between the caller's buffers and the tiers' data planes
  (CPU pools, NVMe data files), in one process: the CLI's spill / restore / bench, replay with data.
- `NullExecutor`: moves nothing and reports success: replay and simulation without data.
Inside vLLM the executor is the connector's worker side (`kvtier.connector.worker`).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from kvtier.core.plan import Plan, Report


class NullExecutor:
    """Every op succeeds; checksums are 0."""

    def run(self, plan: Plan, dsts=None, srcs=None) -> tuple[Report, dict[int, bool]]:
        rep = Report()
        loaded: dict[int, bool] = {}
        for op in plan.loads:
            rep.loaded[op.req_id] = True
            if op.via:
                rep.stored[op.op_id] = [True] * len(op.slots)
            for b in op.block_ids:
                loaded[b] = True
        for op in plan.stores:
            rep.stored[op.op_id] = [True] * len(op.slots)
        for op in plan.copies:
            rep.copied[op.op_id] = [0] * len(op.src_slots)
        return rep, loaded


class LocalExecutor:
    """Runs loads (tier -> caller's buffers, through promotion slots when planned), stores
    (caller's buffers -> tier) and tier-to-tier copies, in that order, and waits for them."""

    def __init__(self, tiers: Sequence, count: Callable[[str, float], None] | None = None) -> None:
        self.tiers = list(tiers)
        self._count = count or (lambda k, v=1: None)
        self.errors: list[str] = []   # the I/O errors of the last run (errno and path, as the engine says)

    def run(self, plan: Plan, dsts: Sequence[torch.Tensor] | None = None,
            srcs: Sequence[torch.Tensor] | None = None) -> tuple[Report, dict[int, bool]]:
        """Returns the report and, per caller block id loaded, whether its bytes arrived."""
        rep = Report()
        loaded: dict[int, bool] = {}
        self.errors = []
        for op in plan.loads:
            tier = self.tiers[op.tier]
            via = self.tiers[op.via_tier] if op.via else None
            bufs = [via.view(s) for s in op.via] if via is not None else [dsts[b] for b in op.block_ids]
            remote = getattr(tier, "remote", False)
            r = (tier.get(op.keys, bufs) if remote else tier.read(op.slots, bufs)).wait()
            self._count(f"bytes_read.{tier.name}", r.nbytes)
            if via is not None:
                for b, buf, ok in zip(op.block_ids, bufs, r.ok):
                    if ok:
                        dsts[b].copy_(buf)
                rep.stored[op.op_id] = list(r.ok)
            bad = [s for s, ok in zip(op.slots, r.ok) if not ok]
            if bad and remote:  # absent (evicted by the server) or failed verification: a miss
                rep.gone.extend(k for k, ok in zip(op.keys, r.ok) if not ok)
            elif bad:
                rep.corrupt.setdefault(op.tier, []).extend(bad)
            rep.loaded[op.req_id] = rep.loaded.get(op.req_id, True) and not bad
            loaded.update(zip(op.block_ids, r.ok))
        failed: set[tuple[int, int]] = set()  # (tier, slot) whose store failed: no copy source
        for op in plan.stores:
            tier = self.tiers[op.tier]
            r = tier.write(op.slots, [srcs[b] for b in op.block_ids]).wait()
            self._count(f"bytes_written.{tier.name}", r.nbytes)
            self.errors.extend(r.errors)
            rep.stored[op.op_id] = list(r.ok)
            failed.update((op.tier, s) for s, ok in zip(op.slots, r.ok) if not ok)
        for op in plan.copies:
            src, tier = self.tiers[op.src_tier], self.tiers[op.tier]
            bufs = [src.view(s) for s in op.src_slots]
            if getattr(tier, "remote", False):
                r = tier.put(op.keys, bufs).wait()
                self._count(f"bytes_written.{tier.name}", r.nbytes)
                rep.copied[op.op_id] = [0 if ok and (op.src_tier, s) not in failed else -1
                                              for ok, s in zip(r.ok, op.src_slots)]
                continue
            r = tier.write(op.slots, bufs).wait()
            self._count(f"bytes_written.{tier.name}", r.nbytes)
            self.errors.extend(r.errors)
            sums = tier.checksums(op.slots) if hasattr(tier, "checksums") else [0] * len(op.slots)
            rep.copied[op.op_id] = [c if ok and (op.src_tier, s) not in failed else -1
                                          for c, ok, s in zip(sums, r.ok, op.src_slots)]
        return rep, loaded
