"""GPU tier: an adapter over the scheduler's block pool (kvtier does not own GPU memory).

`SchedulerContext` is the scheduler-side surface kvtier needs from the engine: look a block
up, pin / unpin blocks (reference counts), and walk the evictable blocks in eviction order
from a resumable cursor. vLLM (0.32/0.33) does not offer that hook itself; it hands the
connector its `BlockPool` through `bind_gpu_block_pool`, and `BlockPoolContext` builds the
context from it. If a future vLLM calls `bind_scheduler_context(ctx)`, the connector takes
`ctx` as is.

Facts used (checked in vllm 0.32 `v1/core/block_pool.py`, `v1/core/kv_cache_utils.py`):
- `BlockPool.blocks[i]` is `KVCacheBlock(block_id, ref_cnt, block_hash, is_null, ...)`;
  `block_hash` is `BlockHashWithGroupId` (hash bytes + 4-byte big-endian group id) or None.
- `BlockPool.touch(blocks)` / `free_blocks(blocks)` take KVCacheBlock objects (not ids);
  touch takes a free block off the free queue, free_blocks puts it back (at the tail when it
  has a hash, so a block that was protected for a copy keeps its cache entry).
- `BlockPool.free_block_queue.iter_blocks_after(cursor)` walks the free queue from the LRU
  head (cursor None) or from after `cursor` (a KVCacheBlock).
"""

from __future__ import annotations

from typing import Any, Iterator, Protocol, Sequence, runtime_checkable

from .base import BlockView


@runtime_checkable
class SchedulerContext(Protocol):
    """What kvtier needs from the engine's GPU block pool."""

    @property
    def num_blocks(self) -> int: ...
    def get_block(self, block_id: int) -> BlockView: ...
    def touch(self, block_ids: Sequence[int]) -> None: ...
    def free_blocks(self, block_ids: Sequence[int]) -> None: ...
    def iter_free_blocks(self, after: BlockView | int | None = None) -> Iterator[BlockView]: ...
    def get_num_free_blocks(self) -> int: ...


def _view(b: Any) -> BlockView:
    h = b.block_hash
    return BlockView(b.block_id, b.ref_cnt, bytes(h) if h is not None else None, bool(b.is_null))


class BlockPoolContext:
    """SchedulerContext over a vLLM `BlockPool` (or anything with the same shape)."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        q = getattr(pool, "free_block_queue", None)
        self._has_cursor = q is not None and hasattr(q, "iter_blocks_after")

    @property
    def num_blocks(self) -> int:
        return len(self.pool.blocks)

    def get_block(self, block_id: int) -> BlockView:
        return _view(self.pool.blocks[block_id])

    def touch(self, block_ids: Sequence[int]) -> None:
        blocks = self.pool.blocks
        self.pool.touch([blocks[i] for i in block_ids])

    def free_blocks(self, block_ids: Sequence[int]) -> None:
        blocks = self.pool.blocks
        self.pool.free_blocks([blocks[i] for i in block_ids])

    def get_num_free_blocks(self) -> int:
        return self.pool.get_num_free_blocks()

    def iter_free_blocks(self, after: BlockView | int | None = None) -> Iterator[BlockView]:
        """Free blocks (ref_cnt 0) from the LRU head, or after `after` while it is still free.

        A cursor whose block left the free queue (ref_cnt > 0 now) restarts from the head.
        """
        q = self.pool.free_block_queue
        cursor = None
        if after is not None:
            bid = after.block_id if isinstance(after, BlockView) else int(after)
            b = self.pool.blocks[bid]
            if b.ref_cnt == 0 and not b.is_null and (b.prev_free_block is not None or b.next_free_block is not None):
                cursor = b
        if self._has_cursor:
            it = q.iter_blocks_after(cursor)
        else:  # older vLLM: walk the linked list ourselves
            it = _walk(q, cursor)
        for b in it:
            if b.ref_cnt == 0 and not b.is_null:
                yield _view(b)


def _walk(q: Any, cursor: Any) -> Iterator[Any]:
    cur = q.fake_free_list_head.next_free_block if cursor is None else cursor.next_free_block
    tail = q.fake_free_list_tail
    while cur is not None and cur is not tail:
        yield cur
        cur = cur.next_free_block
