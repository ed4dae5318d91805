"""Finished requests whose KV is still being copied out: vLLM's delay-free protocol.

On a GPU a store's copies run after `wait_for_save` returned (connector/pending_stores.py). A
request that finishes while a store of its blocks is still unreported is held: `request_finished`
returns delay_free=True, so vLLM keeps its blocks, and the next step's metadata names it with
those stores (`KVTierMetadata.sending`). Each worker reports it in `finished_sending` once, in
the first `get_finished` where none of those stores is still copying on that worker (completed,
failed, or dropped at shutdown), or after `HOLD_LIMIT_S` (counted: `held_release_timeouts`).
vLLM frees the blocks once every worker reported it (`KVOutputAggregator`, world size: every rank
reports, a rank with nothing copying at once). The CPU backend copies in the hook: never held.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Iterable

from kvtier.common.counters import Metric

log = logging.getLogger("kvtier.connector")

HOLD_LIMIT_S = 60.0   # the longest a worker holds a request for its stores


class StoreHolds:
    """Scheduler side: each request's store ops not yet reported, and the requests held for them."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled                    # stores complete in a later step (a GPU)
        self.ops: dict[str, set[int]] = {}        # request -> store ops planned, not reported
        self.of_op: dict[int, str] = {}
        self.announce: dict[str, list[int]] = {}  # held, to be named in the next step's metadata
        self.held: dict[str, float] = {}          # held until vLLM's finished_sending names it

    def planned(self, req_id: str, op_id: int) -> None:
        if self.enabled and op_id:
            self.ops.setdefault(req_id, set()).add(op_id)
            self.of_op[op_id] = req_id

    def reported(self, op_ids: Iterable[int]) -> None:
        """Stores a worker report names (stored or failed): no longer a reason to hold."""
        for op in op_ids:
            rid = self.of_op.pop(op, None)
            ops = self.ops.get(rid) if rid is not None else None
            if ops is not None:
                ops.discard(op)
                if not ops:
                    del self.ops[rid]

    def finish(self, req_id: str) -> bool:
        """`req_id` finished: held (True) when some of its stores are not reported yet."""
        ops = self.ops.pop(req_id, None)
        if not ops:
            return False
        for op in ops:
            self.of_op.pop(op, None)
        self.announce[req_id] = sorted(ops)
        self.held[req_id] = time.monotonic()
        return True

    def take_announce(self) -> dict[str, list[int]]:
        out, self.announce = self.announce, {}
        return out

    def released(self, req_ids: Iterable[str]) -> None:
        for rid in req_ids:
            self.held.pop(rid, None)

    def pending(self) -> bool:
        """A request held (within twice the workers' bound): vLLM keeps stepping to release it."""
        now = time.monotonic()
        return any(now - t < 2 * HOLD_LIMIT_S for t in self.held.values())


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
                      "their stores still copying (the compute stream still waits for those copies)",
                      late, self.limit_s)
        return out

    def take_all(self) -> set[str]:
        """Every held request (a failed hook's safe answer: never held forever)."""
        out = set(self.held)
        self.held.clear()
        return out
