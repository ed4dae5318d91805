"""Lazy offload: store only what vLLM is about to lose.

Instead of storing every block in the step that computes it (eager), the scheduler walks vLLM's
GPU free queue from its LRU head and copies down the cached blocks kvtier lacks before vLLM
reuses them, and writes finished requests' blocks behind, at most `budget` blocks a step.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any, Callable, Sequence

from kvtier.core.controller import TierController
from kvtier.common.counters import Metric

from .drain import DrainBudget

log = logging.getLogger("kvtier.connector")


class LazyOffload:
    """What the lazy walk has seen and holds: the finished requests' blocks still to write, the
    GPU blocks protected while their copy runs, and the free queue's unhashed slack."""

    PROBE = 4          # stored blocks in a row at the free queue's head that end the walk
    BEHIND_MAX = 1 << 16  # finished requests' blocks waiting to be written behind, at most
    DRAIN_S = 30.0     # seconds of idle steps without progress after which writing behind gives up

    def __init__(self, ctrl: TierController, gpu: Any, count: Callable[..., None],
                 clock: Callable[[], float] | None = None) -> None:
        self.ctrl = ctrl
        self.gpu = gpu                        # SchedulerContext (kvtier.tiers.gpu)
        self._count = count
        self.behind: deque[tuple[bytes, int]] = deque()    # (key, GPU block) of finished requests
        self.ops: dict[int, list[tuple[bytes, int]]] = {}   # store op -> its (key, GPU block)
        self.pinned: dict[int, list[int]] = {}              # store op -> GPU blocks protected for its copy
        # key -> the GPU block it was copied from: not copied again while that block holds it (the
        # top tier may evict the copy; copying it again would churn), again once vLLM reuses it
        self.copied: dict[bytes, int] = {}
        self._copied_key: dict[int, bytes] = {}   # ... and back: at most one entry per GPU block
        self._slack: int | None = None        # blocks without a hash ahead of the cached ones
        self._free_prev = 0
        self.drain = DrainBudget(self.DRAIN_S, clock)   # idle steps (and at shutdown) while work is left

    def plan(self, budget: int) -> None:
        """Up to `budget` GPU blocks this step that kvtier lacks and vLLM keeps only in its prefix
        cache, stored through the controller:

        1. the free queue's LRU head (the blocks vLLM hands out next), walked from the head until
           `PROBE` stored blocks in a row show that the write-behind is ahead of vLLM;
        2. then the blocks of finished requests, oldest first: written behind at the step budget,
           and in steps of their own while the engine is idle (`pending`), so a restart finds them.
        A block vLLM already reused (its hash changed) is skipped and counted (`lazy_lost_blocks`).
        Nothing is scanned twice: with a roomy GPU pool the head is stored and the walk stops at once."""
        self.drain.step(self.work())
        keys: list[bytes] = []
        gpu: list[int] = []
        # vLLM's free queue is [blocks without a hash][cached blocks, LRU first]: vLLM hands out the
        # first part before it evicts a cached block. `_slack` is how many such blocks lay ahead at
        # the last walk, less what vLLM took since (the drop of its free count): while that is a
        # step's budget or more, no cached block is about to go and the head is not walked.
        free_now = self.gpu.get_num_free_blocks()
        if self._slack is not None:
            self._slack -= max(0, self._free_prev - free_now)
        self._free_prev = free_now
        if self._slack is None or self._slack < budget:
            seen = held = unhashed = 0
            for b in self.gpu.iter_free_blocks(None):
                if seen >= 2 * budget or len(keys) >= budget or held >= self.PROBE:
                    break
                seen += 1
                k = b.block_hash
                if k is None:
                    unhashed += 1
                    continue
                if self.ctrl.holds(k, 0) or self.was_copied(k):
                    held += 1
                    continue
                held = 0
                keys.append(k)
                gpu.append(b.block_id)
            self._slack = unhashed
            self._count(Metric.N_LAZY_SCANNED.key, seen)
        taken = set(gpu)
        while self.behind and len(keys) < budget:
            k, bid = self.behind.popleft()
            if bid in taken or self.ctrl.holds(k, 0) or self.was_copied(k):
                continue
            if self.gpu.get_block(bid).block_hash != k:   # vLLM evicted it before we got to it
                self._count(Metric.LAZY_LOST_BLOCKS.key)
                continue
            keys.append(k)
            gpu.append(bid)
            taken.add(bid)
        if not keys:
            return
        planned, op_id, _ = self.ctrl.store(keys, gpu)
        if planned:
            ids = [gpu[i] for i in planned]
            self.gpu.touch(ids)                 # vLLM cannot reuse them until the copy is done
            self.pinned[op_id] = ids
            self.ops[op_id] = [(keys[i], gpu[i]) for i in planned]
            for i in planned:
                self._copied_from(keys[i], gpu[i])
            self._count(Metric.LAZY_OFFLOAD_BLOCKS.key, len(ids))

    def was_copied(self, key: bytes) -> bool:
        """Copied down from a GPU block that still holds it (this GPU residency)."""
        b = self.copied.get(key)
        return b is not None and self.gpu.get_block(b).block_hash == key

    def _copied_from(self, key: bytes, block_id: int) -> None:
        old = self._copied_key.pop(block_id, None)
        if old is not None and self.copied.get(old) == block_id:
            del self.copied[old]
        self.copied[key] = block_id
        self._copied_key[block_id] = key

    def write_behind(self, keys: Sequence[bytes], block_ids: Sequence[int]) -> None:
        """Queue a finished request's full blocks (oldest first), bounded by `BEHIND_MAX`."""
        for k, b in zip(keys, block_ids):
            if not self.ctrl.holds(k, 0) and not self.was_copied(k):
                self.behind.append((k, b))
        over = len(self.behind) - self.BEHIND_MAX
        if over > 0:
            for _ in range(over):
                self.behind.popleft()
            self._count(Metric.LAZY_LOST_BLOCKS.key, over)

    def work(self) -> int:
        """Blocks still to write behind, GPU blocks being copied and copy ops in flight."""
        return len(self.behind) + self.gpu_pinned + self.ctrl.in_flight

    def pending(self) -> bool:
        """Blocks still to write behind, or copies in flight, while the drain budget lasts (steps
        that make progress, a stall or clock jump costing one step; at shutdown vLLM's timeout):
        vLLM keeps stepping (empty steps) until they are done."""
        if not (self.behind or self.ctrl.in_flight):
            return False
        return self.drain.open

    def report_shutdown(self) -> int:
        """One line at shutdown: the finished requests' blocks left unwritten (counted), or none."""
        left = len(self.behind) + self.gpu_pinned
        d = self.drain
        if not left:
            log.info("kvtier: shutdown: write-behind complete, no finished request's block left unwritten")
            return 0
        why = (f"in the {d.stop_budget:.1f} s that vLLM's --shutdown-timeout left" if d.stop_budget is not None
               else f"after {d.limit_s:.0f} s of steps without progress" if not d.open
               else "before vLLM shut down")
        log.warning("kvtier: shutdown: write-behind: %d finished requests' blocks not written %s "
                    "(misses after a restart)", left, why)
        self._count(Metric.LAZY_UNWRITTEN_BLOCKS.key, left)
        return left

    def on_stored(self, op_id: int, oks: Sequence[bool]) -> None:
        """A store op's report: its GPU blocks go back to vLLM; a failed copy is tried again (the
        block may still be in vLLM's cache)."""
        ids = self.pinned.pop(op_id, None)
        if ids is not None:
            self.gpu.free_blocks(ids)
        lazy = self.ops.pop(op_id, None)
        if lazy is not None:
            lost = [kb for kb, ok in zip(lazy, oks) if not ok]
            for k, b in lost:
                if self.copied.get(k) == b:
                    del self.copied[k], self._copied_key[b]
            self.behind.extendleft(reversed(lost))

    @property
    def gpu_pinned(self) -> int:
        return sum(map(len, self.pinned.values()))
