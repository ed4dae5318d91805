"""Lazy offload over vLLM's real BlockPool: the free queue's LRU head (the blocks vLLM reuses next)
and the write-behind of finished requests' blocks."""

from __future__ import annotations

import pytest

from kvtier.connector.metadata import KVTierWorkerMeta
from kvtier.connector.scheduler import KVTierScheduler
from kvtier.policies import EVICTION
from kvtier.tiers.base import SlotTier
from kvtier.tiers.gpu import BlockPoolContext

bp = pytest.importorskip("vllm.v1.core.block_pool")
ku = pytest.importorskip("vllm.v1.core.kv_cache_utils")


def pool_with_hashed(n_hashed=5, n=None):
    """A pool whose free queue is one unhashed block then `n_hashed` cached ones (the null block
    aside); with a larger `n`, never-used blocks come first."""
    n = n_hashed + 2 if n is None else n
    pool = bp.BlockPool(num_gpu_blocks=n, enable_caching=True, hash_block_size=4)
    blocks = pool.get_new_blocks(n_hashed + 1)
    for i, b in enumerate(blocks[:n_hashed]):
        b.set_block_hash(ku.make_block_hash_with_group_id(ku.BlockHash(bytes([i + 1]) * 32), 0))
    pool.free_blocks(blocks)        # hashed ones go to the tail in this order, the unhashed one to the head
    return pool, blocks[:n_hashed]


def make(budget, cap=16):
    tier = SlotTier("cpu", cap, 64, EVICTION.get("lru")(cap))
    return KVTierScheduler([tier], 4, offload="lazy", max_blocks_per_step=budget), tier


def step(s, ok=True):
    meta = s.build_meta([])
    s.on_worker_meta(KVTierWorkerMeta(stored={op.op_id: [ok] * len(op.slots) for op in meta.stores}))
    return meta


def test_lazy_walks_lru_head_bounded_and_protects():
    pool, hashed = pool_with_hashed()
    s, tier = make(budget=2)
    s.bind_gpu(BlockPoolContext(pool))
    meta = s.build_meta([])
    ids = [b.block_id for b in hashed]
    assert [op.block_ids for op in meta.stores] == [ids[:2]]          # LRU first, budget 2
    assert all(pool.blocks[i].ref_cnt == 1 for i in ids[:2])          # protected while copied
    free_ids = [b.block_id for b in pool.free_block_queue.iter_blocks_after(None)]
    assert ids[0] not in free_ids and ids[1] not in free_ids
    assert tier.num_resident == 0                                      # not visible before the copy
    op = meta.stores[0]
    s.on_worker_meta(KVTierWorkerMeta(stored={op.op_id: [True, True]}))
    assert all(pool.blocks[i].ref_cnt == 0 for i in ids[:2])          # released when the copy completes
    assert tier.num_resident == 2
    m2 = step(s)
    assert [op.block_ids for op in m2.stores] == [ids[2:4]]           # resumes after the cursor
    m3 = step(s)
    assert [op.block_ids for op in m3.stores] == [ids[4:5]]
    for _ in range(3):                                                 # everything is stored: nothing more
        assert not step(s).stores
    assert tier.num_resident == 5 and s.pinned_blocks() == 0
    assert sum(b.ref_cnt for b in pool.blocks[1:]) == 0


def test_lazy_failed_copy_releases_and_retries():
    pool, hashed = pool_with_hashed(3)
    s, tier = make(budget=8)
    s.bind_gpu(BlockPoolContext(pool))
    step(s, ok=False)
    assert tier.num_resident == 0 and all(b.ref_cnt == 0 for b in hashed)
    step(s)
    assert tier.num_resident == 3


def test_lazy_skips_blocks_taken_by_vllm():
    pool, hashed = pool_with_hashed(4)
    s, tier = make(budget=8)
    s.bind_gpu(BlockPoolContext(pool))
    pool.touch([hashed[1]])                                            # vLLM reuses one (prefix hit)
    meta = s.build_meta([])
    assert meta.stores[0].block_ids == [hashed[0].block_id, hashed[2].block_id, hashed[3].block_id]


class _Req:
    def __init__(self, rid, hashes, num_tokens):
        self.request_id = rid
        self.block_hashes = hashes
        self.num_tokens = num_tokens


def test_finished_requests_are_written_behind_not_scanned():
    """A roomy pool: never-used blocks at the head, the finished request's cached blocks deep in
    the queue. The walk stops at once (nothing there is about to be reused); the request's blocks
    are written behind from its finish, also in steps with nothing scheduled, and then the engine
    may idle (has_pending_push_work)."""
    pool, hashed = pool_with_hashed(5, n=40)
    s, tier = make(budget=2)
    s.bind_gpu(BlockPoolContext(pool))
    assert not s.build_meta([]).stores and s.totals["n_lazy_scanned"] == 4   # 2 x budget, all unused
    assert not s.has_pending_push_work()
    hashes = [bytes(b.block_hash)[:32] for b in hashed]
    req = _Req("r", [ku.BlockHash(h) for h in hashes], 5 * 4 + 1)
    s.lookup(req, 0)
    ids = [b.block_id for b in hashed]
    assert s.on_finished("r", ids) == (False, None)
    assert s.has_pending_push_work()
    stored = []
    for _ in range(4):
        stored += [op.block_ids for op in step(s).stores]
    assert stored == [ids[:2], ids[2:4], ids[4:]]
    assert tier.num_resident == 5 and not s.has_pending_push_work()


def test_write_behind_skips_blocks_vllm_reused():
    pool, hashed = pool_with_hashed(3, n=40)
    s, tier = make(budget=8)
    s.bind_gpu(BlockPoolContext(pool))
    req = _Req("r", [ku.BlockHash(bytes(b.block_hash)[:32]) for b in hashed], 13)
    s.lookup(req, 0)
    s.on_finished("r", [b.block_id for b in hashed])
    hashed[1].reset_hash()                      # vLLM evicted it for another request
    assert [op.block_ids for op in step(s).stores] == [[hashed[0].block_id, hashed[2].block_id]]
    assert s.totals["lazy_lost_blocks"] == 1
