"""The tiers' data planes in one process, by tier index (`Planes`): what the executor and its
handlers (`kvtier.core.handlers`) look a tier's plane, DRAM pool and name up in."""

from __future__ import annotations

from typing import Sequence

from kvtier.tiers.contract import DataPlane, Medium


class Planes:
    """`planes[i]`: tier i's data plane (CpuPool, NvmeData or SharedData), None where this process has
    none; `tier_names` name the counters (`bytes_loaded.<tier>`...); `block_bytes`: one block."""

    def __init__(self, planes: Sequence[DataPlane | None], block_bytes: int, tier_names: Sequence[str] = ()) -> None:
        self._planes: list[DataPlane | None] = list(planes)
        self.block_bytes = block_bytes
        self._names = list(tier_names)

    def bind(self, tier_names: Sequence[str] | None = None, planes: dict[int, DataPlane | None] | None = None,
             ntiers: int = 0) -> None:
        """The tiers' names (when given), and tiers' data planes by index (None: none here);
        `ntiers`: room for that many."""
        if tier_names:
            self._names = list(tier_names)
        for t, p in (planes or {}).items():
            self._planes += [None] * (t + 1 - len(self._planes))
            self._planes[t] = p
        self._planes += [None] * (ntiers - len(self._planes))

    def name(self, tier: int) -> str:
        return self._names[tier] if tier < len(self._names) else str(tier)

    def get(self, tier: int) -> DataPlane | None:
        """Tier `tier`'s plane, None when this process has none."""
        return self._planes[tier] if tier < len(self._planes) else None

    def plane_of(self, tier: int, medium: Medium | None = None) -> DataPlane:
        p = self.get(tier)
        if p is None:
            raise RuntimeError(f"no data plane for tier {self.name(tier)} in this process")
        if medium is not None and p.medium is not medium:
            raise RuntimeError(f"tier {self.name(tier)} is {p.medium.name}, not {medium.name}")
        return p

    def host_pool(self, tier: int, slots: Sequence[int] | None = None):
        """Tier `tier`'s DRAM pool; `slots` must lie in it (a worker's pool may be smaller than the
        scheduler's tier until the scheduler follows its report)."""
        pool = self.plane_of(tier, Medium.HOST)
        if slots and max(slots) >= pool.num_slots:
            raise RuntimeError(f"slot {max(slots)} beyond the {pool.num_slots}-slot pool of tier {self.name(tier)}")
        return pool
