"""TierStack: storage tiers (CPU, NVMe) under one policy engine, driven without vLLM.

Control decisions come from the PolicyEngine; bytes move through each tier's data plane.
Public surface: lookup / match (side-effect free), get / put (bytes in and out, with
promotion and write-back demotion), flush, and the lease API plan / commit / release.
"""

from __future__ import annotations

import errno as _errno

import logging
from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch

from kvtier.policies.base import RequestInfo, _NO_INFO
from kvtier.tiers.base import SlotTier, group_by_tier, match_prefix

from .config import StackConfig, load_config
from .engine import PolicyEngine, make_eviction
from .leases import Lease, LeaseTable
from .metrics import StackMetrics

log = logging.getLogger("kvtier.stack")


@dataclass
class Match:
    """Where each block of a matched prefix lives: parallel lists, prefix order."""

    tier: list[int]
    slot: list[int]

    @property
    def num_blocks(self) -> int:
        return len(self.tier)

    def segments(self) -> list[tuple[int, int, int]]:
        """Runs of consecutive blocks in one tier: (tier, start, end)."""
        tier = self.tier
        if not tier or tier.count(tier[0]) == len(tier):  # the common case: one tier
            return [(tier[0], 0, len(tier))] if tier else []
        out: list[tuple[int, int, int]] = []
        for i, t in enumerate(tier):
            if out and out[-1][0] == t:
                out[-1] = (t, out[-1][1], i + 1)
            else:
                out.append((t, i, i + 1))
        return out


def build_tier(cfg: StackConfig, index: int, with_data: bool, fingerprint: dict | None) -> SlotTier:
    t = cfg.storage_tiers()[index]
    cap = t.blocks(cfg.block_bytes)
    eviction = make_eviction(cfg, t, cap)
    if t.kind == "cpu":
        from kvtier.tiers.cpu import CpuTier
        return CpuTier(t.name, cap, cfg.block_bytes, eviction, pin=t.pin, with_data=with_data)
    if t.kind == "nvme":
        from kvtier.tiers.nvme import NvmeTier
        return NvmeTier(t.name, t.path, cap, cfg.block_bytes, eviction, io=t.io,
                        fingerprint=fingerprint or cfg.fingerprint(), on_mismatch=t.on_fingerprint_mismatch,
                        with_data=with_data, io_threads=t.io_threads)
    raise ValueError(f"tier {t.name!r}: kind {t.kind!r} is not a storage tier")


class TierStack:
    def __init__(self, cfg: StackConfig, tiers: Sequence[SlotTier], with_data: bool = True,
                 lease_timeout_s: float = 60.0) -> None:
        self.cfg = cfg
        self.tiers = list(tiers)
        self.with_data = with_data
        self.block_bytes = cfg.block_bytes
        self.engine = PolicyEngine(cfg, self.tiers)
        self.metrics = StackMetrics()
        self.leases = LeaseTable(self._pin, self._unpin, lease_timeout_s)
        self._index = [t._slot_of for t in self.tiers]  # read-only fast path for lookups
        self._names = [t.name for t in self.tiers]
        # blocks cleaned per write-back batch: cfg.writeback_bytes worth, at most a quarter of the tier
        self._writeback = [max(1, min(cfg.writeback_bytes // cfg.block_bytes, t.capacity_blocks // 4))
                           for t in self.tiers]
        self._ahead = list(self._writeback)  # the current write-back window (adapts, see _write_back_ahead)

    @classmethod
    def from_config(cls, cfg: StackConfig | str | None = None, with_data: bool = True,
                    fingerprint: dict | None = None, **kw: Any) -> "TierStack":
        if not isinstance(cfg, StackConfig):
            cfg = load_config(cfg)
        tiers: list[SlotTier] = []
        try:
            for i in range(len(cfg.storage_tiers())):
                tiers.append(build_tier(cfg, i, with_data, fingerprint))
        except BaseException:
            for t in tiers:
                _close(t)
            raise
        return cls(cfg, tiers, with_data, **kw)

    # ---- control plane: lookups ----------------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> int:
        """Length of the prefix of `keys` present in some tier. No side effects."""
        idx = self._index
        n = 0
        for k in keys:
            for d in idx:
                if k in d:
                    break
            else:
                break
            n += 1
        return n

    def match(self, keys: Sequence[bytes]) -> Match:
        """Where each block of the present prefix lives (the topmost copy)."""
        return Match(*match_prefix(self._index, keys))

    # ---- leases ----------------------------------------------------------------------------
    def _pin(self, blocks: Sequence[tuple[int, int]]) -> None:
        for ti, slots in group_by_tier(blocks).items():
            self.tiers[ti].touch(slots)

    def _unpin(self, blocks: Sequence[tuple[int, int]]) -> None:
        for ti, slots in group_by_tier(blocks).items():
            self.tiers[ti].free_blocks(slots)

    def plan(self, request_id: str, keys: Sequence[bytes], start: int = 0) -> Lease:
        """Match keys[start:] and pin the matched blocks under a lease (idempotent per range)."""
        keys = keys[start:]
        lease = self.leases.get(request_id, start, keys)
        if lease is not None:
            return lease
        m = self.match(keys)
        self.metrics.lookups += 1
        self.metrics.lookup_blocks += len(keys)
        return self.leases.take(request_id, start, keys, list(zip(m.tier, m.slot)))

    def commit(self, request_id: str, num_blocks: int) -> Lease | None:
        return self.leases.commit(request_id, num_blocks)

    def release(self, request_id: str) -> int:
        return self.leases.release(request_id)

    abort = release

    # ---- data plane ------------------------------------------------------------------------
    def get(self, keys: Sequence[bytes], dsts: Sequence[torch.Tensor] | None = None,
            info: RequestInfo = _NO_INFO, match: Match | None = None) -> int:
        """Serve the present prefix of `keys` into `dsts`; returns blocks served.

        A block that fails verification ends the prefix there (it and the rest are misses).
        Blocks served from a lower tier are promoted as the promotion policy says. `match` may
        carry a fresh self.match(keys) to save the walk.
        """
        m = match if match is not None else self.match(keys)
        n = m.num_blocks
        blocks = list(zip(m.tier, m.slot))
        self._pin(blocks)
        try:
            if self.with_data and dsts is not None and n:
                n = self._read_prefix(m, dsts)
            served_tier = m.tier[:n]
            for ti, start, end in Match(served_tier, m.slot[:n]).segments():
                self.tiers[ti].hit(m.slot[start:end], info)
                self.metrics.hits[self._names[ti]] += end - start
        finally:
            self._unpin(blocks)
        self.metrics.misses += len(keys) - n
        self._promote(keys, m, n, dsts, info)
        return n

    def _read_prefix(self, m: Match, dsts: Sequence[torch.Tensor]) -> int:
        handles = []
        for ti, start, end in m.segments():
            handles.append((ti, start, self.tiers[ti].read(m.slot[start:end], dsts[start:end])))
        served = m.num_blocks
        for ti, start, h in handles:
            r = h.wait()
            name = self._names[ti]
            self.metrics.bytes_read[name] += r.nbytes
            for j, ok in enumerate(r.ok):
                if not ok:
                    self.metrics.corrupt[name] += 1
                    served = min(served, start + j)
        return served

    def _promote(self, keys: Sequence[bytes], m: Match, n: int, dsts, info: RequestInfo) -> None:
        tier_l = m.tier
        if not any(tier_l[:n]):  # every block was served by the top tier
            return
        by_target: dict[int, list[int]] = {}
        targets: dict[int, int | None] = {}  # hit tier -> promotion target, asked once per call
        for i in range(n):
            ti = tier_l[i]
            if ti == 0:
                continue
            if ti not in targets:
                targets[ti] = self.engine.promote_target(ti)
            tgt = targets[ti]
            if tgt is not None and tgt < ti:
                by_target.setdefault(tgt, []).append(i)
        for tgt, idxs in by_target.items():
            pkeys = [keys[i] for i in idxs]
            srcs = [dsts[i] for i in idxs] if (self.with_data and dsts is not None) else None
            if self.with_data and srcs is None:
                continue  # nothing read, nothing to copy up
            stored = self._store(tgt, pkeys, srcs, info, admit=False)
            self.metrics.promoted[self._names[tgt]] += stored
            if not self.engine.inclusive:
                for i in idxs:
                    ti = m.tier[i]
                    s = self.tiers[ti].find(keys[i])
                    if s is not None and self.tiers[ti].get_block(s).ref_cnt == 0:
                        self._evict(ti, [s])

    def put(self, keys: Sequence[bytes], srcs: Sequence[torch.Tensor] | None = None,
            info: RequestInfo = _NO_INFO) -> int:
        """Store blocks that no tier holds yet into the top tier; returns blocks stored."""
        new: Sequence[int] = range(len(keys))
        for d in self._index:
            new = [i for i in new if keys[i] not in d]
        stored = 0
        for lo, hi in _runs(new):  # each run of consecutive chain positions, so info.start is right
            run_info = info if lo == 0 else replace(info, start=info.start + lo)
            stored += self._store(0, keys[lo:hi], srcs[lo:hi] if srcs is not None else None, run_info)
        return stored

    def _store(self, ti: int, keys: Sequence[bytes], srcs: Sequence[torch.Tensor] | None,
               info: RequestInfo, admit: bool = True) -> int:
        tier = self.tiers[ti]
        name = self._names[ti]
        resident = self._index[ti]
        if admit:
            verdict = self.engine.admit(ti, keys, info)
            admitted: Sequence[int] = (range(len(verdict)) if all(verdict) else
                                       [i for i, a in enumerate(verdict) if a])
            self.metrics.not_admitted[name] += len(verdict) - len(admitted)
        else:
            admitted = range(len(keys))
        keep = [i for i in admitted if keys[i] not in resident]
        if not keep:
            return 0
        step = tier.capacity_blocks
        if len(keep) > step:  # larger than the tier: the earlier blocks of the batch go down first
            return sum(self._store(ti, [keys[i] for i in keep[j:j + step]],
                                   [srcs[i] for i in keep[j:j + step]] if srcs is not None else None,
                                   info, admit=False) for j in range(0, len(keep), step))
        self._make_room(ti, len(keep))
        room = min(len(keep), tier.num_free_slots)
        if room < len(keep):
            self.metrics.dropped_full[name] += len(keep) - room
            log.debug("tier %s: %d blocks dropped, every other block is pinned", name, len(keep) - room)
            keep = keep[:room]
        if not keep:
            return 0
        slots = tier.allocate(keys if len(keep) == len(keys) else [keys[i] for i in keep], info)
        if self.with_data:
            if srcs is None:
                raise ValueError("put without data on a stack built with data")
            res = tier.write(slots, [srcs[i] for i in keep]).wait()
            self.metrics.bytes_written[name] += res.nbytes
            good = [s for s, ok in zip(slots, res.ok) if ok]
            bad = [s for s, ok in zip(slots, res.ok) if not ok]
            if bad:
                log.error("tier %s: %d block writes failed: %s", name, len(bad), "; ".join(res.errors[:3]))
                tier.abort(bad)
            slots = good
        try:
            tier.commit(slots, info)
        except OSError:  # e.g. fdatasync failed: nothing indexed, the blocks stay where they were
            tier.abort(slots)
            raise
        self.metrics.stored[name] += len(slots)
        if self.with_data and bad:
            # loud: the caller stops before evicting the upper copies of the failed blocks
            err = res.errors[0] if res.errors else "write failed"
            raise OSError(_errno.EIO, f"tier {name}: {len(bad)} of {len(bad) + len(slots)} block writes failed "
                          f"(kept in the tier above, not indexed): {err}")
        return len(slots)

    def _make_room(self, ti: int, n: int) -> None:
        tier = self.tiers[ti]
        need = n - tier.num_free_slots
        if need <= 0:
            return
        victims = self.engine.victims(ti, need)
        if not victims:
            return
        if ti + 1 < len(self.tiers):
            lower, key_of = self._index[ti + 1], tier._key_of
            for s in victims:
                if key_of[s] not in lower:  # a victim is dirty
                    self._write_back_ahead(ti, need)
                    break
        self._evict(ti, victims)

    def _write_back_ahead(self, ti: int, need: int) -> None:
        """Clean the head of tier `ti`'s cursor in one batch (one sync, one index commit); the
        blocks stay resident here and later leave without I/O. The window is `writeback_bytes`
        while the head is mostly dirty (a fill, a recency-ordered tier) and halves while under a
        quarter of it is (a policy that ranks new blocks first: the rest was cleaned before), so
        the walk costs about what it cleans."""
        window = self._ahead[ti]
        ahead = self.engine.victims(ti, max(need, window))
        dirty = self._demote(ti, ahead)
        if 4 * dirty < len(ahead):
            self._ahead[ti] = max(1, window // 2)
        elif 4 * dirty >= 3 * len(ahead):
            self._ahead[ti] = min(self._writeback[ti], 2 * window)

    def _demote(self, ti: int, slots: Sequence[int]) -> int:
        """Write-back: copy blocks to the next tier (admission permitting); they stay here.
        Returns how many of `slots` the next tier lacked (the dirty ones)."""
        tier, lower = self.tiers[ti], self._index[ti + 1]
        key_of = tier._key_of
        slots = [s for s in slots if key_of[s] not in lower]
        if not slots:
            return 0
        keys = [key_of[s] for s in slots]
        srcs = [tier.view(s) for s in slots] if self.with_data else None
        tier.touch(slots)
        try:
            n = self._store(ti + 1, keys, srcs, _NO_INFO)
        finally:
            tier.free_blocks(slots)
        self.metrics.demoted[self._names[ti + 1]] += n
        return len(slots)

    def _evict(self, ti: int, slots: Sequence[int]) -> None:
        keys = self.tiers[ti].evict(slots)
        self.engine.on_evict(ti, keys)
        self.metrics.evicted[self._names[ti]] += len(keys)

    def flush(self, ti: int = 0, batch: int = 256, progress=None) -> int:
        """Copy every resident block of tier `ti` that the next tier lacks down to it (kept above)."""
        if ti + 1 >= len(self.tiers):
            return 0
        tier, lower = self.tiers[ti], self.tiers[ti + 1]
        todo = [s for k, s in list(tier._slot_of.items()) if k not in lower]
        before = self.metrics.demoted[lower.name]
        for i in range(0, len(todo), batch):
            self._demote(ti, todo[i:i + batch])
            if progress:
                progress(len(todo[i:i + batch]))
        return self.metrics.demoted[lower.name] - before

    def clear(self) -> int:
        """Drop every resident block of every tier (a persistent tier's index too) and start each
        eviction policy afresh; nothing may be leased. Returns the blocks dropped."""
        if self.leases.leases:
            raise RuntimeError(f"clear with {len(self.leases.leases)} leases held")
        n = 0
        for t, tcfg in zip(self.tiers, self.cfg.storage_tiers()):
            slots = list(t._slot_of.values())
            if slots:
                t.evict(slots)
                n += len(slots)
            t.eviction = make_eviction(self.cfg, tcfg, t.capacity_blocks)
        return n

    # ---- introspection ---------------------------------------------------------------------
    def stats(self) -> dict:
        return {"block_bytes": self.block_bytes, "tiers": [t.stats() for t in self.tiers],
                "policies": self.engine.describe(), "leases": len(self.leases.leases),
                "metrics": self.metrics.as_dict()}

    def close(self) -> None:
        self.leases.expire(float("inf"))
        for t in reversed(self.tiers):  # lower tiers first: their in-flight writes read upper tiers' memory
            _close(t)

    def __enter__(self) -> "TierStack":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _runs(positions: list[int]) -> list[tuple[int, int]]:
    """[2,3,4,7,8] -> [(2,5), (7,9)] (positions ascending)."""
    if not positions or positions[-1] - positions[0] == len(positions) - 1:  # one run, or none
        return [(positions[0], positions[-1] + 1)] if positions else []
    out: list[tuple[int, int]] = []
    for p in positions:
        if out and out[-1][1] == p:
            out[-1] = (out[-1][0], p + 1)
        else:
            out.append((p, p + 1))
    return out


def _close(t: Any) -> None:
    close = getattr(t, "close", None)
    if close:
        close()
