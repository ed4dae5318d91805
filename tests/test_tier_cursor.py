"""SlotTier's iter_free_blocks cursor: resumes after a free block, restarts from the head otherwise."""

from hypothesis import given, settings, strategies as st

from kvtier.policies import EVICTION
from kvtier.tiers.base import BlockView, SlotTier

CAP = 12


def make(name, n):
    t = SlotTier("t", CAP, 64, EVICTION.get(name)(CAP))
    slots = t.allocate([i.to_bytes(4, "big") for i in range(n)])
    t.commit(slots)
    return t, slots


@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from(["lru", "arc"]), n=st.integers(2, CAP),  # s3fifo moves blocks while walked
       pins=st.lists(st.integers(0, CAP - 1), max_size=4), pick=st.integers(0, CAP - 1), hit=st.booleans())
def test_resume_and_restart(name, n, pins, pick, hit):
    t, slots = make(name, n)
    if hit:
        t.hit(slots[: n // 2])
    pinned = {slots[p % n] for p in pins}
    t.touch(sorted(pinned))
    full = [b.block_id for b in t.iter_free_blocks()]
    assert sorted(full) == sorted(set(slots) - pinned)  # every evictable block once, no pinned one
    assert all(t.get_block(b).ref_cnt == 0 for b in full)
    if not full:
        return
    cur = full[pick % len(full)]
    rest = [b.block_id for b in t.iter_free_blocks(after=t.get_block(cur))]
    assert rest == full[full.index(cur) + 1:]
    t.touch([cur])  # the cursor's block left the free set: restart from the head
    again = [b.block_id for b in t.iter_free_blocks(after=cur)]
    assert again == [b for b in full if b != cur]
    t.free_blocks([cur])


def test_evict_pinned_refused_and_views_read_only():
    t, slots = make("lru", 3)
    t.touch([slots[0]])
    import pytest
    with pytest.raises(ValueError, match="pinned"):
        t.evict([slots[0]])
    v = t.get_block(slots[0])
    assert isinstance(v, BlockView) and v.ref_cnt == 1 and v.block_hash == (0).to_bytes(4, "big")
    with pytest.raises(AttributeError):
        v.ref_cnt = 0
    with pytest.raises(ValueError, match="ref_cnt 0"):
        t.free_blocks([slots[1]])
