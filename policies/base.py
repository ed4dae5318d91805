"""Policy interfaces and their registries.

A policy is a small class chosen by name in YAML. Eviction policies own the order in
which a tier's `iter_free_blocks` cursor yields victims; they see slots (ints) and keys,
never a tier's internals. Admission and promotion policies answer the engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator, Sequence


@dataclass(slots=True)
class RequestInfo:
    """What a request tells the policies about the blocks it touches.

    `keys` is the request's whole chain (prefix order); `start` is the chain position of the
    first block of the call; `hit_blocks` is how many leading blocks were found in the stack;
    `num_tokens` and `block_tokens` tell whether the last block is partial; `now` is a clock.
    `output_tokens` is how many tokens the request generated (0 = unknown): known when the
    request finishes, which is when a serving engine offloads its blocks. `tenant`: the
    request's tenant (its cache_salt or a kv_transfer_params field), for quotas and counters.
    """

    keys: Sequence[bytes] = ()
    start: int = 0
    hit_blocks: int = 0
    num_tokens: int = 0
    block_tokens: int = 0
    now: float = 0.0
    request_id: str | None = None
    output_tokens: int = 0
    tenant: str | None = None   # who stored / asks (kvtier.core.tenants), None: no tenant

    def is_full(self, pos: int) -> bool:
        """Whether block `pos` of the chain holds block_tokens tokens (unknown -> True)."""
        if not self.num_tokens or not self.block_tokens:
            return True
        return (pos + 1) * self.block_tokens <= self.num_tokens


NO_INFO = RequestInfo()


class EvictionPolicy(ABC):
    """Victim order over the resident slots of one tier.

    The tier calls on_insert / on_hit / on_remove; `victims(after)` yields resident slots in
    eviction order (the tier skips pinned ones), starting after slot `after` when given.
    A generator may reorganise lazily (S3-FIFO moves, clock hands) as it walks.
    """

    name: ClassVar[str] = ""

    def __init__(self, capacity: int, **params: Any) -> None:
        self.capacity = capacity

    @abstractmethod
    def on_insert(self, slots: Sequence[int], keys: Sequence[bytes], info: RequestInfo = NO_INFO) -> None: ...

    @abstractmethod
    def on_hit(self, slots: Sequence[int], info: RequestInfo = NO_INFO) -> None: ...

    @abstractmethod
    def on_remove(self, slot: int, key: bytes) -> None: ...

    @abstractmethod
    def victims(self, after: int | None = None) -> Iterator[int]: ...

    def on_remove_many(self, slots: Sequence[int], keys: Sequence[bytes]) -> None:
        """on_remove for each (slot, key), in order (a batch; overridable)."""
        for s, k in zip(slots, keys):
            self.on_remove(s, k)

    def take_victims(self, n: int, pinned: Sequence[int]) -> list[int]:
        """The first `n` slots of victims() whose `pinned[slot]` is 0 (a batch; overridable)."""
        out: list[int] = []
        if n > 0:
            for s in self.victims(None):
                if not pinned[s]:
                    out.append(s)
                    if len(out) >= n:
                        break
        return out

    def contains(self, slot: int) -> bool:  # pragma: no cover - optional
        raise NotImplementedError


class AdmissionPolicy(ABC):
    """Whether blocks are worth writing to a tier at all."""

    name: ClassVar[str] = ""

    def __init__(self, **params: Any) -> None:
        pass

    @abstractmethod
    def admit(self, keys: Sequence[bytes], info: RequestInfo = NO_INFO) -> list[bool]: ...

    def on_evict(self, key: bytes) -> None:
        """A block left the tier (for ghost history)."""


class PromotionPolicy(ABC):
    """On a lower-tier hit: promote to which tier, keeping a copy behind or not."""

    name: ClassVar[str] = ""
    inclusive: bool = True

    def __init__(self, **params: Any) -> None:
        pass

    @abstractmethod
    def target(self, hit_tier: int, num_tiers: int) -> int | None:
        """Tier index to copy a block hit in `hit_tier` to, or None to serve in place."""


# Retired policies (git history keeps them; docs/policies.md, "What we tried"): name -> what to use.
RETIRED = {"hawk": "lru", "nextuse": "lru", "plru": "lru", "pslru": "lru", "duel": "lru",
           "bypass": "all", "continuation": "all"}


def retired(name: str) -> str | None:
    """Why `name` is refused, if it names a retired policy."""
    if name not in RETIRED:
        return None
    return (f"policy {name!r} was retired (below vLLM's LRU on traffic it was not tuned on; "
            f"see docs/policies.md); use {RETIRED[name]!r}")


@dataclass
class Registry:
    kind: str
    classes: dict[str, type] = field(default_factory=dict)

    def register(self, cls: type) -> type:
        if not cls.name:
            raise TypeError(f"{cls.__name__} has no name")
        self.classes[cls.name] = cls
        return cls

    def get(self, name: str) -> type:
        try:
            return self.classes[name]
        except KeyError:
            if retired(name):
                raise KeyError(f"{self.kind} {retired(name)}") from None
            raise KeyError(f"unknown {self.kind} policy {name!r}; known: {', '.join(sorted(self.classes))}") from None

    def names(self) -> list[str]:
        return sorted(self.classes)


EVICTION = Registry("eviction")
ADMISSION = Registry("admission")
PROMOTION = Registry("promotion")
