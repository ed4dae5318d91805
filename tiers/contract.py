"""The tier contracts: what the controller asks of every tier and of the slot tiers, and what the
executor asks of every data plane.

`Tier` is what every tier answers, in the paired-verb shape vLLM's offloading uses: `lookup` /
`holds` (what it holds), `prepare_load` / `complete_load` (a load's use and outcome),
`complete_store` (a store's outcome), plus what it declares (`shared`, `ready`, `medium`,
`verifies`, ...) and its lifecycle. Blocks are named by the tier's address: a slot, or for the
shared tier (`shared.SharedTier`, `shared.SimSharedTier`: the fleet's Redis/Valkey tier, whose
server owns membership and eviction) a key. `SlotTierContract` is what only slot tiers have
(`base.SlotTier`: CPU, NVMe, a closed tier): slots, pins, the eviction cursor, a block's life
(`allocate` -> `commit` / `abort` -> `evict`). The controller asks it of its local tiers only;
the shared tier answers `Tier` alone, so it answers nothing with a no-op (nothing to reserve for
a store: the server names blocks by key and evicts on its own).

`DataPlane` is the bytes side, one per tier in the process that moves them (`cpu_pool.CpuPool`,
`nvme_data.NvmeData`, `shared_data.SharedData`): `read` / `write` blocks named by slots and keys
into or out of given buffers, each returning a handle whose `IOResult` gives per-block outcomes
(`ok`, `bad`: failed verification, `tags`: what a write sealed).
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Mapping, NamedTuple, Protocol, Sequence, runtime_checkable

import torch

from kvtier.policies.base import NO_INFO, RequestInfo

from .io_engine import IOHandle


class Medium(enum.Enum):
    """Where blocks are held: a tier's data plane (its `medium`), or the caller's blocks outside
    the tiers. The executor's handlers are keyed by (source medium, destination medium)
    (`kvtier.core.handlers`)."""

    HOST = "DRAM slots"            # tiers.cpu_pool.CpuPool
    FILE = "a file of slots"       # tiers.nvme_data.NvmeData
    SHARED = "a shared server"     # tiers.shared_data.SharedData
    OUTSIDE = "the caller's blocks"  # vLLM's KV cache, the CLI's buffers (kvtier.core.outside)


class BlockView(NamedTuple):
    """Read-only view of one block, the shape vLLM's KVCacheBlock offers."""

    block_id: int
    ref_cnt: int
    block_hash: bytes | None
    is_null: bool = False


@runtime_checkable
class Tier(Protocol):
    """What every tier answers (control plane only: it never touches bytes), in vLLM's paired-verb
    shape. A block is named by the tier's address: a slot (a slot tier), a key (the shared tier;
    its slots in a plan are placeholders)."""

    # ---- what it declares (read by the controller and the drivers; never probed for)
    name: str
    kind: str             # its config kind ("cpu", "nvme", "shared", "closed": for reports)
    medium: Medium        # what holds its bytes (the executor's handlers are keyed by it)
    shared: bool          # the shared tier: server-owned membership (see the module docstring)
    ready: bool           # open: serves and takes blocks (`closed.ClosedTier`: not yet)
    verifies: bool        # a load carries each block's expected tag (`prepare_load`)
    data_plane: Any       # its bytes in this process (`DataPlane`), or None
    capacity_blocks: int  # blocks it holds (the shared tier: as modelled; 0: the server's memory)
    eviction_name: str    # its eviction policy's name ("server": the server's)

    # ---- lookup: no side effects
    def lookup(self, keys: Sequence[bytes], wait: bool = True) -> int | None:
        """Length of the prefix of `keys` held here; None: asked, answer pending (the shared
        tier with `wait=False` only)."""
        ...

    def holds(self, key: bytes) -> bool:
        """Held here, as known without I/O (the shared tier: as far as known here)."""
        ...

    # ---- load: prepare (a use recorded; what the reads carry), complete (what they found)
    def prepare_load(self, slots: Sequence[int], keys: Sequence[bytes], verify: bool,
                     info: RequestInfo = NO_INFO) -> tuple[list | None, list[bytes] | None]:
        """The blocks at `slots` (named `keys`) are loaded: record the use; returns what the
        reads carry: (expected tags, keys), each None when not needed."""
        ...

    def complete_load(self, bad: Sequence = (), gone: Sequence = ()) -> None:
        """Loads found these blocks `bad` (failed verification) or `gone` (missing), named by the
        tier's address: out of service, a miss for the lookups that follow."""
        ...

    # ---- store: complete (slot tiers prepare through `SlotTierContract.allocate`; the shared
    # tier has nothing to reserve: the server names blocks by key)
    def complete_store(self, slots: Sequence[int], keys: Sequence[bytes], sums: Sequence,
                       info: RequestInfo = NO_INFO) -> None:
        """Writes of these blocks ended: `sums[i]` is block i's tag, -1 when its write failed.
        The written ones are held from now on, the failed ones released."""
        ...

    # ---- the rest (a tier that subclasses `Tier` with nothing to count, wait for or release
    # inherits these three)
    def stats(self) -> dict: ...
    def summary(self) -> str: ...

    def bind_counter(self, count: Callable[..., None]) -> None:
        """Count the tier's own events (network, index writes) into the controller's counters."""

    def drain(self) -> None:
        """Wait for the transfers its data plane has in flight (before buffers they read are freed)."""

    def close(self) -> None:
        """Release what the tier holds (connections, files, locks, memory)."""


@runtime_checkable
class SlotTierContract(Tier, Protocol):
    """What a slot tier (`base.SlotTier`: CPU, NVMe, a closed tier) answers besides `Tier`: its
    slots, pins and eviction. The controller asks these of its local tiers only."""

    eviction: Any         # its eviction policy (the tenants split it by account)

    @property
    def num_free_slots(self) -> int: ...
    @property
    def resident(self) -> Mapping[bytes, int]: ...
    def find(self, key: bytes) -> int | None: ...
    def key_at(self, slot: int) -> bytes | None: ...
    def get_block(self, block_id: int) -> BlockView: ...

    # ---- pins
    def touch(self, block_ids: Sequence[int]) -> None: ...
    def free_blocks(self, block_ids: Sequence[int]) -> None: ...
    def unpin_if(self, slot: int, key: bytes) -> bool: ...
    def pinned_blocks(self) -> int: ...

    # ---- a block's life: allocate -> (written) -> commit / abort -> evict
    def allocate(self, keys: Sequence[bytes], info: RequestInfo = NO_INFO) -> list[int]: ...
    def commit(self, slots: Sequence[int], info: RequestInfo = NO_INFO) -> None: ...
    def commit_written(self, slots: Sequence[int], sums: Sequence, info: RequestInfo = NO_INFO) -> None:
        """Pending slots an executor wrote and made durable, with their tags: published."""
        ...
    def abort(self, slots: Sequence[int]) -> None: ...
    def free_slots(self, n: int) -> list[int]: ...
    def evict(self, block_ids: Sequence[int]) -> list[bytes]: ...
    def limit(self, n: int) -> list[bytes]: ...


@runtime_checkable
class DataPlane(Protocol):
    """A tier's bytes in this process. Blocks are named by `slots` (a slot plane's address) and
    `keys` (sealed into and checked against each block's header; the shared plane's address,
    where `slots` are placeholders). A failure is a per-block outcome, never a raise from the
    handle: `ok[i]` False, `bad[i]` True when the block was there but failed verification."""

    medium: Medium

    def read(self, slots: Sequence[int], dsts: Sequence[torch.Tensor], keys: Sequence[bytes] | None = None,
             expect: Sequence | None = None) -> IOHandle:
        """Into `dsts`; `expect[i]`: block i's tag (planes that verify against the index)."""
        ...

    def write(self, slots: Sequence[int], srcs: Sequence[torch.Tensor],
              keys: Sequence[bytes] | None = None) -> IOHandle:
        """From `srcs` (unchanged until the handle is done); the result's `tags[i]` is block i's
        tag when the plane seals one."""
        ...

    def sync(self) -> None:
        """Written blocks are durable (a file: fdatasync; DRAM, a server: nothing to do)."""
        ...

    def drain(self) -> None:
        """Wait for every transfer in flight (before the buffers they touch are freed)."""
        ...

    def close(self) -> None: ...
