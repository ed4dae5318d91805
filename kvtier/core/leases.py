"""Leases: pins on matched lower-tier blocks between lookup and load.

vLLM asks how many tokens match (maybe many times), then allocates, then tells the accepted
count. A lease pins the matched blocks from the first ask; asking again for the same request
and range never pins twice; commit keeps the accepted prefix and releases the rest; release
(finish, preemption, abort, not chosen) or expiry unpins everything.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence


@dataclass
class Lease:
    request_id: str
    start: int                       # chain position of the first leased block
    keys: tuple[bytes, ...]          # the keys asked for (from start)
    blocks: list[tuple[int, int]]    # (tier index, slot) per matched block, in prefix order
    deadline: float
    committed: bool = False

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


@dataclass
class LeaseTable:
    """Lease bookkeeping; `pin` / `unpin` take [(tier, slot)] and do the tiers' ref counts."""

    pin: Callable[[Sequence[tuple[int, int]]], None]
    unpin: Callable[[Sequence[tuple[int, int]]], None]
    timeout_s: float = 60.0
    clock: Callable[[], float] = time.monotonic
    leases: dict[str, Lease] = field(default_factory=dict)
    expired: int = 0

    def __len__(self) -> int:
        """Requests holding a lease."""
        return len(self.leases)

    def get(self, request_id: str, start: int, keys: Sequence[bytes]) -> Lease | None:
        """The live lease for exactly this request and range, if any."""
        lease = self.leases.get(request_id)
        if lease is not None and lease.start == start and lease.keys == tuple(keys):
            return lease
        return None

    def take(self, request_id: str, start: int, keys: Sequence[bytes], blocks: list[tuple[int, int]]) -> Lease:
        """Pin `blocks` for the request, replacing any lease it held on another range."""
        self.release(request_id)
        self.pin(blocks)
        lease = Lease(request_id, start, tuple(keys), blocks, self.clock() + self.timeout_s)
        self.leases[request_id] = lease
        return lease

    def commit(self, request_id: str, num_blocks: int) -> Lease | None:
        """Keep the first `num_blocks` pinned (until release), unpin the rest; 0 releases all."""
        lease = self.leases.get(request_id)
        if lease is None:
            return None
        if num_blocks <= 0:
            self.release(request_id)
            return None
        num_blocks = min(num_blocks, lease.num_blocks)
        self.unpin(lease.blocks[num_blocks:])
        del lease.blocks[num_blocks:]
        lease.keys = lease.keys[:num_blocks]
        lease.committed = True
        return lease

    def held(self, request_id: str) -> int:
        """Blocks the request's lease pins (0: no lease)."""
        lease = self.leases.get(request_id)
        return lease.num_blocks if lease is not None else 0

    def release(self, request_id: str) -> int:
        lease = self.leases.pop(request_id, None)
        if lease is None:
            return 0
        self.unpin(lease.blocks)
        return lease.num_blocks

    def expire(self, now: float | None = None) -> list[str]:
        """Release leases past their deadline; returns their request ids."""
        now = self.clock() if now is None else now
        stale = [r for r, l in self.leases.items() if l.deadline <= now]
        for r in stale:
            self.release(r)
        self.expired += len(stale)
        return stale

    def pinned(self) -> int:
        return sum(l.num_blocks for l in self.leases.values())
