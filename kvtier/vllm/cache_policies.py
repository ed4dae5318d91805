"""kvtier's eviction policies as vLLM `CachePolicy` classes, for the CPU primary tier of vLLM's
native offloading:

    "eviction_policy": "KvtierARC", "cache_policy_module_path": "kvtier.vllm"

Each class runs kvtier's policy object (`kvtier.policies`, the one the stack runs) over the
primary tier's chunk slots (`ChunkStatus.chunk_id`): insert / touch / remove become the policy's
on_insert / on_hit / on_remove and `evict` walks its victim cursor, skipping pinned (ref_cnt != 0)
and protected chunks; it takes all `n` or changes nothing. `KvtierLRU` evicts in exactly the
order of vLLM's own `LRUCachePolicy` (a touched prefix head-last, new chunks most recent).
`KvtierARC` and `KvtierS3FIFO` are frequency-aware: a request's reuse counts as a hit, its own
insertions do not (vLLM's `on_request_finished` classification). Differences from vLLM's
`ARCCachePolicy`: kvtier's ARC admits a ghost hit straight into T2 (the paper's ARC) where
vLLM's inserts it into T1 and adapts the target only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus, order_request_keys

from kvtier.policies import EVICTION, EvictionPolicy


class KvtierCachePolicy(CachePolicy):
    """A kvtier eviction policy (`policy`, by registry name) behind vLLM's CachePolicy."""

    policy: ClassVar[str] = ""
    params: ClassVar[dict[str, Any]] = {}
    reuse_only: ClassVar[bool] = True   # on request finish, hit only the chunks the request reused

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.chunks: dict[OffloadKey, ChunkStatus] = {}
        self._key_of: dict[int, OffloadKey] = {}
        self._p = self._new()

    def _new(self) -> EvictionPolicy:
        return EVICTION.get(self.policy)(max(1, self.cache_capacity), **self.params)

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self.chunks.get(key)

    def insert(self, key: OffloadKey, chunk: ChunkStatus, req_context: ReqContext | None = None) -> None:
        """(vLLM 0.33 passes the storing request's context; 0.32 does not.)"""
        self.chunks[key] = chunk
        self._key_of[chunk.chunk_id] = key
        self._p.on_insert([chunk.chunk_id], [key])

    def remove(self, key: OffloadKey) -> None:
        chunk = self.chunks.pop(key)
        del self._key_of[chunk.chunk_id]
        self._p.on_remove(chunk.chunk_id, key)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        slots = [c.chunk_id for c in (self.chunks.get(k) for k in keys) if c is not None]
        if slots:
            self._p.on_hit(slots)

    def on_request_finished(self, key_groups: Sequence[Sequence[OffloadKey]], insertion_only_keys: set[OffloadKey],
                            reused_keys: set[OffloadKey], req_context: ReqContext) -> None:
        keys = order_request_keys(key_groups, req_context)
        if self.reuse_only:
            keys = [k for k in keys if k in reused_keys]
        self.touch(keys, req_context)

    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        if n <= 0:
            return []
        chosen: list[tuple[OffloadKey, ChunkStatus]] = []
        key_of, chunks = self._key_of, self.chunks
        for slot in self._p.victims(None):
            key = key_of.get(slot)
            if key is None or key in protected:
                continue
            chunk = chunks[key]
            if chunk.ref_cnt != 0:
                continue
            chosen.append((key, chunk))
            if len(chosen) == n:
                break
        if len(chosen) < n:
            return None
        for key, chunk in chosen:
            del chunks[key]
            del key_of[chunk.chunk_id]
        self._p.on_remove_many([c.chunk_id for _, c in chosen], [k for k, _ in chosen])
        return chosen

    def clear(self) -> None:
        self.chunks.clear()
        self._key_of.clear()
        self._p = self._new()


class KvtierLRU(KvtierCachePolicy):
    """kvtier's LRU in vLLM's order: the same victims as vLLM's LRUCachePolicy."""

    policy = "lru"
    reuse_only = False


class KvtierARC(KvtierCachePolicy):
    """kvtier's ARC (T1/T2 with ghost lists B1/B2; a ghost hit enters T2)."""

    policy = "arc"


class KvtierS3FIFO(KvtierCachePolicy):
    """kvtier's S3-FIFO (a small probationary FIFO, a main FIFO and a ghost FIFO)."""

    policy = "s3fifo"
