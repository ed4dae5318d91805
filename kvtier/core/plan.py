"""What the controller asks executors to do (ops, a plan) and what they report back.

Plain, picklable data: in vLLM the plan crosses from the scheduler process to the workers and
the report comes back. `block_ids` are the caller's blocks: vLLM's GPU block ids inside vLLM,
indices into the caller's buffers offline.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


@dataclass
class LoadOp:
    """Copy tier slots into the caller's blocks (before the forward that reads them); from the
    shared tier `slots` are placeholders and `keys` name the blocks."""

    req_id: str
    tier: int
    slots: list[int]
    block_ids: list[int]
    checksums: list[int | tuple[int, ...]] | None = None  # NVMe: expected per slot (per rank: a tuple)
    via: list[int] | None = None         # promotion: slots of `via_tier` to read through, reported as op_id
    op_id: int = 0
    via_tier: int = 0
    keys: list[bytes] | None = None      # NVMe: the block keys (each block's header must name its key)


@dataclass
class StoreOp:
    """Copy the caller's blocks into tier slots the controller reserved."""

    op_id: int
    tier: int
    slots: list[int]
    block_ids: list[int]
    keys: list[bytes] = field(default_factory=list)  # a tier that verifies (NVMe): sealed into each header


@dataclass
class CopyOp:
    """Copy slots of one tier into reserved slots of the next (write-through or write-back), or
    into the shared tier (`slots` then empty: the server names blocks by `keys`). In vLLM the
    source is always the CPU tier."""

    op_id: int
    src_slots: list[int]
    slots: list[int]
    keys: list[bytes] = field(default_factory=list)  # the block keys, sealed into each block's header
    src_tier: int = 0
    tier: int = 1


@dataclass
class Plan:
    loads: list[LoadOp] = field(default_factory=list)
    stores: list[StoreOp] = field(default_factory=list)
    copies: list[CopyOp] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not self.loads and not self.stores and not self.copies


@dataclass
class Report:
    """An executor's results: store op -> per-block ok, request -> load ok, copy op -> per-slot
    checksum (-1: failed), tier -> slots that failed verification, tier -> blocks whose load
    failed for any reason (`unread`: the controller remembers them, `kvtier.core.ledger`).

    Aggregating over workers (tensor parallel ranks) ANDs the flags and keeps each rank's store
    results (`stored_ranks`: a store completes once every rank reported it, maybe in different
    steps) and copy checksums (ranks hold different shards in different files)."""

    stored: dict[int, list[bool]] = field(default_factory=dict)
    loaded: dict[str, bool] = field(default_factory=dict)
    copied: dict[int, list[int]] = field(default_factory=dict)
    corrupt: dict[int, list[int]] = field(default_factory=dict)
    rank: int = 0
    copied_ranks: dict[int, dict[int, list[int]]] = field(default_factory=dict)
    gone: list[bytes] = field(default_factory=list)   # shared tier: keys a read found absent or bad
    bad: list[bytes] = field(default_factory=list)    # shared tier: those of `gone` that failed verification
    capacity: dict[int, int] = field(default_factory=dict)  # tier -> slots its data plane holds (when fewer)
    unread: dict[int, list] = field(default_factory=dict)   # tier -> blocks whose load failed: slots (keys: shared)
    stored_ranks: dict[int, dict[int, list[bool]]] = field(default_factory=dict)  # aggregated: op -> rank -> oks
    store_tags: dict[int, dict[int, list[int]]] = field(default_factory=dict)  # op -> rank -> per block tag (a file)

    @classmethod
    def of_plan(cls, plan: Plan, ok: bool, ranks: int = 0) -> "Report":
        """Every op of `plan` reported at once, done (`ok`: what moves nothing reports) or failed
        (what cannot run: loads are load errors, stores and copies are not committed). `ranks`:
        stores and copies as each of that many ranks' report (0: this one's)."""
        rep = ReportBuilder(cls=cls)
        each = range(ranks) if ranks else [None]
        for op in plan.loads:
            rep.loaded(op.req_id, ok)
            if op.via:
                for r in each:
                    rep.stored(op.op_id, [ok] * len(op.slots), rank=r)
        for op in plan.stores:
            for r in each:
                rep.stored(op.op_id, [ok] * len(op.slots), rank=r)
        tag = 0 if ok else -1
        for op in plan.copies:
            for r in each:
                rep.copied(op.op_id, [tag] * len(op.src_slots), rank=r)
        return rep.take() or cls()

    def stored_by_rank(self) -> dict[int, dict[int, list[bool]]]:
        """Store op -> rank -> per-block ok, over every rank reported (`stored` is this rank's for
        the ops `stored_ranks` lacks)."""
        out = {op: {r: list(oks) for r, oks in by.items()} for op, by in self.stored_ranks.items()}
        for op, oks in self.stored.items():
            if op not in out:
                out[op] = {self.rank: list(oks)}
        return out

    def written_by_rank(self) -> dict[int, dict[int, list[int]]]:
        """Copy op -> rank -> per-slot checksums (-1: failed), over every rank reported."""
        out = {op: dict(r) for op, r in self.copied_ranks.items()}
        for op, sums in self.copied.items():
            out.setdefault(op, {})[self.rank] = list(sums)
        return out

    def aggregate(self, other: "Report") -> "Report":
        stored = dict(self.stored)
        for op, oks in other.stored.items():
            mine = stored.get(op)
            stored[op] = list(oks) if mine is None else [a and b for a, b in zip(mine, oks)]
        stored_ranks = self.stored_by_rank()
        for op, by_rank in other.stored_by_rank().items():
            mine = stored_ranks.setdefault(op, {})
            for r, oks in by_rank.items():
                mine[r] = list(oks) if r not in mine else [a and b for a, b in zip(mine[r], oks)]
        loaded = dict(self.loaded)
        for r, ok in other.loaded.items():
            loaded[r] = loaded.get(r, True) and ok
        written = self.written_by_rank()
        for op, by_rank in other.written_by_rank().items():
            written.setdefault(op, {}).update(by_rank)
        corrupt = {t: list(v) for t, v in self.corrupt.items()}
        for t, v in other.corrupt.items():
            corrupt.setdefault(t, []).extend(s for s in v if s not in corrupt[t])
        gone = list(self.gone) + [k for k in other.gone if k not in self.gone]
        bad = list(self.bad) + [k for k in other.bad if k not in self.bad]
        capacity = dict(self.capacity)
        for t, n in other.capacity.items():
            capacity[t] = min(n, capacity.get(t, n))
        unread = {t: list(v) for t, v in self.unread.items()}
        for t, v in other.unread.items():
            unread.setdefault(t, []).extend(x for x in v if x not in unread[t])
        tags = {op: dict(r) for op, r in self.store_tags.items()}
        for op, by_rank in other.store_tags.items():
            tags.setdefault(op, {}).update(by_rank)
        return type(self)(stored=stored, loaded=loaded, corrupt=corrupt, rank=self.rank,
                          copied_ranks=written, gone=gone, bad=bad, capacity=capacity, unread=unread,
                          stored_ranks=stored_ranks, store_tags=tags)

    def is_empty(self) -> bool:
        return not self.stored and not self.loaded and not self.copied and not self.corrupt \
            and not self.copied_ranks and not self.gone and not self.bad and not self.capacity and not self.unread \
            and not self.stored_ranks and not self.store_tags


class ReportBuilder:
    """The one place a report is built: an executor and its parts (handlers, copies down,
    deferred stores, failures) add each op's outcome here; `take` hands the report over (once
    per step). `cls`: the report's class (a worker's carries it to vLLM)."""

    def __init__(self, rank: int = 0, cls: type[Report] = Report) -> None:
        self.rank = rank
        self._cls = cls
        self._rep = cls(rank=rank)
        self.corrupt_blocks = 0   # blocks that failed verification, over every report taken

    def stored(self, op_id: int, oks: Sequence[bool], rank: int | None = None,
               tags: Sequence[int] | None = None) -> None:
        """Store (or promotion) `op_id`: per block, whether its bytes are in its slot; `rank`: as
        that rank's. `tags`: a store into a data file, per block the tag it was sealed with (-1:
        not written), durable already (the controller indexes them)."""
        if rank is None:
            self._rep.stored[op_id] = list(oks)
        else:
            self._rep.stored_ranks.setdefault(op_id, {})[rank] = list(oks)
        if tags is not None:
            self._rep.store_tags.setdefault(op_id, {})[self.rank if rank is None else rank] = list(tags)

    def not_stored(self, op_id: int, n: int, unless_reported: bool = False) -> int:
        """Store `op_id`'s `n` blocks failed (`unless_reported`: only if it has no result yet);
        returns the blocks newly reported failed."""
        if unless_reported and op_id in self._rep.stored:
            return 0
        self._rep.stored[op_id] = [False] * n
        return n

    def loaded(self, req_id: str, ok: bool) -> None:
        """A load of request `req_id` finished (`ok`) or failed; a request's loads AND."""
        self._rep.loaded[req_id] = self._rep.loaded.get(req_id, True) and ok

    def load_failed(self, req_id: str) -> bool:
        """Whether a load of `req_id` reported since the last `take` failed."""
        return self._rep.loaded.get(req_id) is False

    def copied(self, op_id: int, tags: Sequence[int], rank: int | None = None) -> None:
        """Copy `op_id`: per slot the block's tag (-1: failed); `rank`: as that rank's."""
        if rank is None:
            self._rep.copied[op_id] = list(tags)
        else:
            self._rep.copied_ranks.setdefault(op_id, {})[rank] = list(tags)

    def corrupt(self, tier: int, slots: Sequence[int]) -> None:
        """Slots of `tier` that failed verification on read."""
        self._rep.corrupt.setdefault(tier, []).extend(slots)
        self.corrupt_blocks += len(slots)

    def shared_misses(self, gone: Sequence[bytes], bad: Sequence[bytes]) -> None:
        """Shared-tier keys a read found absent or bad (`gone`), and those that failed verification."""
        self._rep.gone.extend(gone)
        self._rep.bad.extend(bad)

    def unread(self, tier: int, blocks: Sequence) -> None:
        """Blocks of `tier` whose load failed, for any reason: slots, or keys (the shared tier)."""
        if blocks:
            self._rep.unread.setdefault(tier, []).extend(blocks)

    def capacity(self, slots: dict[int, int]) -> None:
        """Tier -> slots its data plane holds (when fewer than configured)."""
        self._rep.capacity.update(slots)

    def take(self) -> Report | None:
        """The report built since the last `take`, or None when it is empty."""
        r = self._rep
        if r.is_empty():
            return None
        self._rep = self._cls(rank=self.rank)
        return r

    def empty(self) -> Report:
        """A report of nothing (of this builder's class and rank)."""
        return self._cls(rank=self.rank)


class Counters:
    """Counters: cumulative `totals` and the interval since the last `take_interval`. Keys are
    `Metric` keys (`Metric.X.key`, `Metric.X.at(tier)`): `<counter>` or `<counter>.<tier name>`."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self._interval: dict[str, float] = {}

    def count(self, key: str, v: float = 1) -> None:
        self._interval[key] = self._interval.get(key, 0) + v
        self.totals[key] = self.totals.get(key, 0) + v

    def take_interval(self) -> dict[str, float] | None:
        if not any(self._interval.values()):
            return None
        d, self._interval = self._interval, {}
        return d

    def total(self, key: str) -> float:
        return self.totals.get(key, 0)
