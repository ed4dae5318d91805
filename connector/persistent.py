"""The persistent tiers (NVMe, shared) open only once the model's identity is known.

Their blocks are keyed by the fingerprint, and the fingerprint names the model by the digest of
its whole weights (`identity.ModelIdentity`, a thread). At start the scheduler waits up to
`WAIT_S` for it (a digest from the cache, or small weights, is done by then); otherwise the
persistent tiers are built closed (`tiers.closed.ClosedTier`: lookups miss, copies into them are
skipped and counted as `not_open_blocks.<tier>`; the DRAM tier serves) and `poll`, called from the
scheduler's hooks, opens them under the full fingerprint at the first step after the digest is
done, with one log line giving the time it took and its GB/s.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from kvtier.core.builder import build_tier, build_tiers

from kvtier.core.identity import ModelIdentity
from kvtier.common.counters import Metric
from kvtier.tiers.redact import redact

log = logging.getLogger("kvtier.connector")

WAIT_S = 1.0
CLOSED_WHY = "until the weights' digest is done"


class PersistentTiers:
    """Builds the scheduler's tiers and opens the closed ones when `identity` is known.
    `fingerprint_of(model identity)`: the full fingerprint."""

    def __init__(self, cfg: Any, identity: ModelIdentity, fingerprint_of: Callable[[str | None], dict],
                 ranks: int = 1, wait_s: float = WAIT_S) -> None:
        self.cfg = cfg
        self.identity = identity
        self.fingerprint_of = fingerprint_of
        self.ranks = ranks
        self.t0 = time.monotonic()
        identity.done.wait(wait_s)
        self.closed: list[int] = []          # indices of the tiers still closed
        self.failed = False

    def build(self) -> list[Any]:
        """The tiers: all open when the identity is known now, else the persistent ones closed."""
        if self.identity.value is not None:
            return build_tiers(self.cfg, "control", self.fingerprint_of(self.identity.value), ranks=self.ranks)
        tiers = build_tiers(self.cfg, "control", self.fingerprint_of(None), ranks=self.ranks, closed=CLOSED_WHY)
        self.closed = [i for i, t in enumerate(tiers) if not t.ready]
        return tiers

    def poll(self, sched: Any) -> bool:
        """Open the closed tiers once the digest is done (the scheduler's thread); True when it did."""
        if not self.closed or self.failed or not self.identity.done.is_set():
            return False
        ident = self.identity
        if ident.value is None:
            self.failed = True   # identity.py logged why; they stay closed
            sched.count(Metric.IDENTITY_UNKNOWN.key)
            return False
        fp = self.fingerprint_of(ident.value)
        opened = []
        try:
            for i in self.closed:
                tier = build_tier(self.cfg, i, "control", fp, self.ranks)
                sched.open_tier(i, tier)
                opened.append(tier.summary())
        except Exception as e:  # noqa: BLE001 - a directory in use, another fingerprint, ...
            self.failed = True
            sched.count(Metric.PERSISTENT_OPEN_FAILED.key)
            log.error("kvtier: persistent tiers stay closed: opening them failed (%s: %s)", type(e).__name__,
                      redact(str(e)))
            return False
        self.closed = []
        sched.persistent_open(fp["model"])
        log.info("kvtier: persistent tiers open %.1f s after start: %s; model %s (%s)",
                 time.monotonic() - self.t0, "; ".join(opened), ident.value, ident.how)
        return True
