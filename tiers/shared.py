"""The shared tier (Redis / Valkey, standalone or Cluster) as the controller sees it.

Unlike a slot tier it has no local index, no slots and no pins: the server owns membership and
eviction (`maxmemory` + `allkeys-lru`), and other instances write to it too. So:
- membership comes from the server: `lookup(keys)` is the prefix every rank has a value for,
  asked with one pipelined EXISTS for the part not known locally; `wait=False` (the vLLM
  scheduler) answers None while the answer is on its way, so the scheduler never waits on the
  network (vLLM asks again next step);
- a block found by a lookup may be gone when it is read: a handled miss (`complete_load`'s
  `gone`: `note_gone`);
- `holds(key)`: a bounded local memory of keys written or seen, so a block is not put twice;
- `note_bad(keys)` (`complete_load`'s `bad`): values that failed verification (deleted on the server by the reader when
  unchanged) are remembered, in a bounded set, as misses: the next lookup stops before them,
  so a bad value is read once, not again and again. Writing the block again clears the mark.
The bytes move through `shared_data.SharedData` (offline: this object's `data_plane`; in vLLM
each worker opens its own). `SimSharedTier` is the metadata-only model replay runs: an LRU of
`capacity_blocks` (unbounded when 0), as a server with `allkeys-lru` behaves.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence

from kvtier.policies.base import NO_INFO, RequestInfo

from .contract import Medium, Tier
from kvtier.common.counters import Metric
from .shared_conn import Namespace, RedisSettings
from .shared_data import SharedData

log = logging.getLogger("kvtier.shared")

KNOWN_MAX = 1 << 18      # keys remembered as on the server (about 30 MB)
BAD_MAX = 1 << 16        # keys remembered as bad (their oldest marks go first)
PROBES_MAX = 4096        # lookups in flight (a request that never asks again is dropped)


class _Known:
    """A bounded LRU set of keys."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._d: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, k: bytes) -> bool:
        return k in self._d

    def __len__(self) -> int:
        return len(self._d)

    def prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading `keys` are members."""
        d, n = self._d, 0
        for k in keys:
            if k not in d:
                break
            n += 1
        return n

    def add(self, keys) -> list[bytes]:
        """Insert or refresh; returns the keys pushed out (capacity)."""
        d = self._d
        for k in keys:
            d[k] = None
            d.move_to_end(k)
        out = []
        while self.cap and len(d) > self.cap:
            out.append(d.popitem(last=False)[0])
        return out

    def touch(self, keys) -> None:
        d = self._d
        for k in keys:
            if k in d:
                d.move_to_end(k)

    def discard(self, keys) -> None:
        for k in keys:
            self._d.pop(k, None)


class _SharedBase(Tier):
    """A shared tier, as the controller sees it (`contract.Tier` only, `shared`): the server owns
    membership and eviction, so it has no slot, pin or eviction cursor (`contract.SlotTierContract`
    is not its to answer); blocks are named by key. Its subclasses keep the membership known here
    (`holds`, `note_written`, `note_gone`, `note_bad`, `touch_keys`), which the verbs below drive."""

    kind = "shared"
    medium = Medium.SHARED
    shared = True
    verifies = False
    eviction_name = "server"
    capacity_blocks = 0
    data_plane = None
    ready = True

    def summary(self) -> str:
        return f"{self.name} (a shared server's, modelled as an LRU of {self.capacity_blocks} blocks)"

    # ---- the contract's verbs, by key ----------------------------------------------------
    def prepare_load(self, slots: Sequence[int], keys: Sequence[bytes], verify: bool,
                     info: RequestInfo = NO_INFO) -> tuple[None, list[bytes]]:
        """A load names its blocks by key (each value's header is checked against it; `slots` are
        placeholders). The server does its own LRU on GET; the keys are fresh in the local memory."""
        if keys:
            self.touch_keys(keys)
        return None, list(keys)

    def complete_load(self, bad: Sequence[bytes] = (), gone: Sequence[bytes] = ()) -> None:
        """Keys a read found missing (`gone`: not known any more) or failed verification (`bad`:
        a miss for the lookups that follow)."""
        if gone:
            self.note_gone(gone)
        if bad:
            self.note_bad(bad)

    def complete_store(self, slots: Sequence[int], keys: Sequence[bytes], sums: Sequence,
                       info: RequestInfo = NO_INFO) -> None:
        """Puts ended (`slots`: none, the server names blocks by key): the written ones are known."""
        good = [k for k, c in zip(keys, sums) if c != -1]
        if good:
            self.note_written(good)

    @property
    def num_resident(self) -> int:
        """Blocks known here to be on the server (the server may hold more, or fewer)."""
        return 0

    @property
    def num_used(self) -> int:
        """The tier contract's occupancy: the blocks known to be on the server."""
        return self.num_resident


class SharedTier(_SharedBase):
    def __init__(self, name: str, settings: RedisSettings, fingerprint: dict, block_bytes: int,
                 ranks: int = 1, capacity_blocks: int = 0, data: bool = True, threads: int = 4,
                 count: Callable[[str, float], None] | None = None, sealer=None) -> None:
        self.name = name
        self.settings = settings
        self.block_bytes = block_bytes
        self.ranks = max(1, ranks)
        self.capacity_blocks = capacity_blocks
        self.ns = Namespace(fingerprint, settings.secret, rank=0, sealer=sealer)
        self.conn = SharedData(settings, self.ns, block_bytes, threads=threads if data else 1, count=count,
                              name=name)
        self.with_data = data
        self.data_plane = self.conn if data else None
        self._known = _Known(KNOWN_MAX)
        self._bad = _Known(BAD_MAX)
        self._probes: OrderedDict[tuple, tuple[Future, float, int]] = OrderedDict()
        self._prober = ThreadPoolExecutor(1, thread_name_prefix=f"kvtier-{name}-lookup")
        self._count = self.conn.count
        if not self.ns.authenticated:
            log.warning("kvtier: shared tier %s: no secret set (tiers.%s.secret, e.g. ${KVTIER_SHARED_SECRET}): "
                        "blocks are checked for corruption and foreign models, but a client with write access "
                        "to the server could plant blocks", settings.where, name)

    def bind_counter(self, count: Callable[[str, float], None]) -> None:
        """Count network events (`unreachable.<name>`, ...) into the controller's counters too."""
        self.conn.bind_counter(count)

    # ---- membership ----------------------------------------------------------------------
    def holds(self, key: bytes) -> bool:
        return key in self._known

    def note_written(self, keys: Sequence[bytes]) -> None:
        """Written by this instance (a good value now): known, and no longer bad."""
        self._known.add(keys)
        self._bad.discard(keys)

    def note_gone(self, keys: Sequence[bytes]) -> None:
        """Blocks a read found missing or bad: not known any more (a later store puts them again)."""
        self._known.discard(keys)

    def note_bad(self, keys: Sequence[bytes]) -> None:
        """Blocks whose value failed verification: lookups stop before them until one is written
        again here (or its mark is pushed out of the bounded set)."""
        self._known.discard(keys)
        self._bad.add(keys)

    def _clean(self, keys: Sequence[bytes]) -> Sequence[bytes]:
        """`keys` up to the first one marked bad."""
        if not len(self._bad):
            return keys
        for i, k in enumerate(keys):
            if k in self._bad:
                return keys[:i]
        return keys

    def touch_keys(self, keys: Sequence[bytes]) -> None:
        self._known.touch(keys)

    def lookup(self, keys: Sequence[bytes], wait: bool = True) -> int | None:
        """Length of the prefix of `keys` on the server (all ranks); None: asked, answer pending
        (only with `wait=False`). Unreachable or too slow: the locally known part only, counted.
        A block marked bad ends the prefix."""
        keys = self._clean(keys)
        n = self._known.prefix(keys)
        if n == len(keys):
            return n
        rest = tuple(keys[n:])
        if wait:
            return n + self._answer(self.conn.exists(rest, self.ranks), rest)
        entry = self._probes.get(rest)
        if entry is None:
            self._probes[rest] = (self._prober.submit(self.conn.exists, rest, self.ranks), time.monotonic(), n)
            while len(self._probes) > PROBES_MAX:
                self._probes.popitem(last=False)
            return None
        fut, t0, _ = entry
        if not fut.done():
            if time.monotonic() - t0 < self.settings.timeout_s + self.settings.connect_timeout_s:
                return None
            self._count(Metric.LOOKUP_TIMEOUTS)
            del self._probes[rest]
            return n
        del self._probes[rest]
        return n + self._answer(fut.result(), rest)

    def _answer(self, found: list[bool] | None, keys: Sequence[bytes]) -> int:
        if found is None:
            self._count(Metric.LOOKUP_FAILURES)
            return 0
        m = next((i for i, f in enumerate(found) if not f), len(found))
        m = len(self._clean(keys[:m]))  # marked bad while the answer was on its way
        self._known.add(keys[:m])
        return m

    # ---- introspection -------------------------------------------------------------------
    def scan_count(self, limit: int | None = None) -> int | None:
        """Entries of this namespace on the server (all ranks; SCAN, so O(keys)); None: unreachable."""
        try:
            cl = self.conn.client
            n = 0
            for _ in cl.scan_iter(match=self.ns.pattern(), count=1000):
                n += 1
                if limit is not None and n >= limit:
                    break
            return n
        except Exception as e:
            self.conn.breaker.fail(e)
            return None

    @property
    def io_engine(self) -> str:
        return self.conn.description

    def stats(self) -> dict:
        return {"name": self.name, "kind": self.kind, "server": self.settings.where, "namespace": self.ns.ns,
                "known_blocks": len(self._known), "bad_marked_blocks": len(self._bad),
                "block_bytes": self.block_bytes,
                "authenticated": self.ns.authenticated, "server_down": self.conn.breaker.down,
                **{k: int(v) for k, v in self.conn.counters.items()}}

    def summary(self) -> str:
        """The server without credentials."""
        return (f"{self.name} on {self.settings.where} (namespace {self.ns.ns}, "
                f"{'secret set' if self.ns.authenticated else 'no secret: integrity only'}; the server evicts)")

    def drain(self) -> None:
        self.conn.drain()

    def close(self) -> None:
        self._prober.shutdown(wait=False, cancel_futures=True)
        self.conn.close()


class SimSharedTier(_SharedBase):
    """Metadata-only shared tier (replay): the server modelled as an LRU of `capacity_blocks`."""

    def __init__(self, name: str, capacity_blocks: int = 0, block_bytes: int = 0) -> None:
        self.name = name
        self.capacity_blocks = capacity_blocks
        self.block_bytes = block_bytes
        self._on = _Known(capacity_blocks)
        self.evicted = 0

    @property
    def num_resident(self) -> int:
        return len(self._on)

    def holds(self, key: bytes) -> bool:
        return key in self._on

    def note_written(self, keys: Sequence[bytes]) -> None:
        self.evicted += len(self._on.add(keys))

    def note_gone(self, keys: Sequence[bytes]) -> None:
        self._on.discard(keys)

    def note_bad(self, keys: Sequence[bytes]) -> None:
        """The model keeps no bad marks: as `note_gone`."""
        self.note_gone(keys)

    def touch_keys(self, keys: Sequence[bytes]) -> None:
        self._on.touch(keys)

    def lookup(self, keys: Sequence[bytes], wait: bool = True) -> int:
        return self._on.prefix(keys)

    @property
    def io_engine(self) -> str:
        return "none (metadata only: an LRU model of the server)"

    def stats(self) -> dict:
        return {"name": self.name, "kind": self.kind, "capacity_blocks": self.capacity_blocks,
                "resident_blocks": len(self._on), "evicted_blocks": self.evicted, "model": "lru"}
