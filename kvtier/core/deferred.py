"""The executor's copies left running on a device (a part of `kvtier.core.executor.Executor`):
a store's copies are reported once their event completed (`store_done`, polled by the caller in
a later step, or `store_lost`), and host rows a load's copies read are handed out again only
after them (`settle_rows`). No host wait in a step's hooks unless rows are reused under a copy
still running."""

from __future__ import annotations

import logging
from typing import Sequence

from kvtier.tiers.once import cause


class Deferred:
    """Mixed into `Executor`: works on its state (`outside`, `_rows_event`...); outcomes go to its
    `report`."""

    def take_deferred(self) -> tuple | None:
        """The last `store(defer=True)` left running, (planned, event, t0), once; or None."""
        d, self.deferred = self.deferred, None
        return d

    def store_done(self, planned: list, dt: float) -> None:
        """These stores' copies completed: reported stored, counted."""
        by_tier: dict[str, int] = {}
        for op, _ in planned:
            self.report.stored(op.op_id, [True] * len(op.slots))
            by_tier[self.name(op.tier)] = by_tier.get(self.name(op.tier), 0) + len(op.slots)
        for name, n in by_tier.items():
            self._count(f"bytes_stored.{name}", n * self.block_bytes)
            self._count(f"seconds_stored.{name}", dt)
            self._count(f"blocks_stored.{name}", n)

    def store_lost(self, planned: list, e: BaseException) -> set[tuple[int, int]]:
        """These stores' copies failed or were given up: not stored; returns their (tier, slot)s."""
        failed: set[tuple[int, int]] = set()
        for op, _ in planned:
            self.store_failed(op, e, False, failed)
        return failed

    def settle_rows(self, ops: Sequence | None = None) -> None:
        """Before host rows are handed out again: the copies that read them last completed (a
        query; the host waits only for copies still running). With `ops` (loads), only when one
        of them writes host rows (a lower tier's read into staging or promotion slots): a copy
        from DRAM slots writes none."""
        if ops is not None and not any(op.via or self._needs_staging(op) for op in ops):
            return
        ev, self._rows_event = self._rows_event, None
        if ev is None or self.outside.done(ev):
            return
        try:
            self.outside.sync(ev)
        except Exception as e:  # noqa: BLE001 - a device error: the next copies report it
            self.once(("rows_wait",) + cause(e), logging.ERROR, "kvtier: waiting for the last load's copies "
                      "failed: %s", e)

    def pinned_rows(self) -> bool:
        """Rows of their own are pinned (torch's pinned host allocator) when the outside is a
        device's: the staging rows' pinning says so."""
        return bool(self.staging is not None and self.staging.pinned and self.outside.layered)
