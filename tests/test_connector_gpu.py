"""The GPU tier adapter (SchedulerContext over vLLM's BlockPool)."""

from __future__ import annotations

import pytest

from kvtier.tiers.gpu import BlockPoolContext, SchedulerContext

bp = pytest.importorskip("vllm.v1.core.block_pool")


def make_pool(n=8):
    return bp.BlockPool(num_gpu_blocks=n, enable_caching=True, hash_block_size=4)


def test_context_over_real_block_pool():
    pool = make_pool()
    ctx = BlockPoolContext(pool)
    assert isinstance(ctx, SchedulerContext)
    free = [b.block_id for b in ctx.iter_free_blocks()]
    assert free == list(range(1, 8))               # block 0 is vLLM's null block
    blocks = pool.get_new_blocks(3)
    ids = [b.block_id for b in blocks]
    assert [b.block_id for b in ctx.iter_free_blocks()] == [i for i in range(1, 8) if i not in ids]
    pool.free_blocks(blocks)                       # hash-less blocks go to the head
    assert ctx.get_block(ids[0]).ref_cnt == 0
    ctx.touch([ids[0]])                            # protect it: leaves the free queue
    assert ctx.get_block(ids[0]).ref_cnt == 1
    assert ids[0] not in [v.block_id for v in ctx.iter_free_blocks()]
    ctx.free_blocks([ids[0]])
    assert ids[0] in [v.block_id for v in ctx.iter_free_blocks()]


def test_cursor_resumes_and_restarts():
    pool = make_pool()
    ctx = BlockPoolContext(pool)
    it = list(ctx.iter_free_blocks())
    cur = it[2]
    assert [v.block_id for v in ctx.iter_free_blocks(after=cur)] == [v.block_id for v in it[3:]]
    ctx.touch([cur.block_id])                      # the cursor's block left the free set
    assert [v.block_id for v in ctx.iter_free_blocks(after=cur)][0] == it[0].block_id
    ctx.free_blocks([cur.block_id])
