"""The shared tier's lookups in vLLM's per-chunk calls, one server round trip per step.

vLLM asks a secondary tier about each chunk of a request in turn, and keeps asking past a RETRY
within the step. A key kvtier already knows is on the server answers at once; the others are
gathered during the step and asked in one pipelined EXISTS when the step ends (`flush`, from
`on_schedule_end`), on one thread; until the answer is in they are RETRY. A key found joins the
tier's known set (`SharedTier.note_written`); a key not found is a miss for `MISS_TTL_S` (another
instance may store it meanwhile). An unreachable server or an answer later than the tier's
timeouts is a miss, counted.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from kvtier.common.counters import Metric

MISS_TTL_S = 2.0
MISSES_MAX = 1 << 16


class BatchedLookup:
    def __init__(self, tier, count: Callable[[Metric, int], None]) -> None:
        self.tier = tier
        self._count = count
        self._batch: dict[bytes, None] = {}                       # asked this step, in order
        self._keys_of: dict[Future, list[bytes]] = {}
        self._asked: dict[bytes, tuple[Future, float]] = {}
        self._misses: OrderedDict[bytes, float] = OrderedDict()   # key -> when it was found absent
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"kvtier-{tier.name}-lookup")
        s = tier.settings
        self._patience = s.timeout_s + s.connect_timeout_s

    def ask(self, key: bytes) -> bool | None:
        """On the server (True), not (False), or asked and not answered yet (None)."""
        if self.tier.holds(key):
            return True
        t = self._misses.get(key)
        if t is not None:
            if time.monotonic() - t < MISS_TTL_S:
                return False
            del self._misses[key]
        entry = self._asked.get(key)
        if entry is None:
            self._batch[key] = None
            return None
        fut, t0 = entry
        if fut.done():
            self._resolve(fut)
            return self.ask(key) if key not in self._asked else None
        if time.monotonic() - t0 > self._patience:
            self._count(Metric.LOOKUP_TIMEOUTS, 1)
            self._miss([k for k in self._keys_of.pop(fut, []) if k in self._asked and self._asked[k][0] is fut])
            return False
        return None

    def flush(self) -> None:
        """Send the step's questions (one pipelined EXISTS); take in the answers that arrived."""
        for fut in {f for f, _ in self._asked.values() if f.done()}:
            self._resolve(fut)
        if not self._batch:
            return
        keys, self._batch = list(self._batch), {}
        fut = self._pool.submit(self.tier.conn.exists, keys, self.tier.ranks)
        self._keys_of[fut] = keys
        now = time.monotonic()
        for k in keys:
            self._asked[k] = (fut, now)

    def _resolve(self, fut: Future) -> None:
        asked = self._keys_of.pop(fut, [])
        keys = [k for k in asked if k in self._asked and self._asked[k][0] is fut]
        try:
            found = fut.result()
        except Exception:  # noqa: BLE001 - counted as unreachable
            found = None
        if found is None:
            self._count(Metric.LOOKUP_FAILURES, 1)
            found = [False] * len(keys)
        else:
            mine = set(keys)
            found = [f for k, f in zip(asked, found) if k in mine]
        for k in keys:
            del self._asked[k]
        self.tier.note_written([k for k, f in zip(keys, found) if f])
        self._miss([k for k, f in zip(keys, found) if not f])

    def _miss(self, keys: list[bytes]) -> None:
        now = time.monotonic()
        for k in keys:
            self._asked.pop(k, None)
            self._misses[k] = now
            self._misses.move_to_end(k)
        while len(self._misses) > MISSES_MAX:
            self._misses.popitem(last=False)

    def forget_miss(self, keys) -> None:
        """Keys this instance just stored: no longer a remembered miss."""
        for k in keys:
            self._misses.pop(k, None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
