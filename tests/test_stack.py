"""TierStack on real CPU tiers: byte-exact round trips, write-back demotion, promotion, leases."""

import torch
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.offline.blockgen import block_data, block_key
from kvtier.core.config import parse_config
from kvtier.core.stack import TierStack

BB = 8192


def two_cpu(top=4, bottom=16, promotion="inclusive", with_data=True, demotion="write_back", **policy):
    cfg = parse_config({"block_bytes": BB, "tiers": [
        {"name": "hot", "kind": "cpu", "capacity_blocks": top},
        {"name": "warm", "kind": "cpu", "capacity_blocks": bottom}],
        "policy": {"promotion": promotion, "demotion": demotion, **policy}})
    return TierStack.from_config(cfg, with_data=with_data)


def blocks(idx, seed=1):
    return [block_key(seed, i) for i in idx], [block_data(seed, i, BB) for i in idx]


def test_put_get_byte_exact_and_demotion():
    s = two_cpu()
    keys, data = blocks(range(10))
    assert s.put(keys, data) == 10
    # 4 fit on top; the 6 that left were written back below first, and the head of the top
    # tier's cursor was cleaned ahead (2 of the 4 on top are below too)
    assert [t.num_resident for t in s.tiers] == [4, 8]
    assert s.metrics.demoted["warm"] == 8 and s.metrics.evicted["hot"] == 6
    assert sum(k in s.tiers[0] and k in s.tiers[1] for k in keys) == 2
    assert s.lookup(keys) == 10
    out = [torch.empty(BB, dtype=torch.uint8) for _ in keys]
    assert s.get(keys, out) == 10
    for o, d in zip(out, data):
        assert torch.equal(o, d)
    s.close()


def test_write_through_copies_every_stored_block_down():
    s = two_cpu(demotion="write_through")
    keys, data = blocks(range(10))
    assert s.put(keys, data) == 10
    assert [t.num_resident for t in s.tiers] == [4, 10]
    assert s.metrics.demoted["warm"] == 10 and s.metrics.evicted["hot"] == 6
    out = [torch.empty(BB, dtype=torch.uint8) for _ in keys]
    assert s.get(keys, out) == 10
    for o, d in zip(out, data):
        assert torch.equal(o, d)
    s.close()


def test_lookup_is_side_effect_free_and_prefix():
    s = two_cpu()
    keys, data = blocks(range(6))
    s.put(keys[:3], data[:3])
    order = list(s.tiers[0].iter_free_slots())
    assert s.lookup(keys) == 3
    assert s.lookup([keys[1]] + keys) == 4
    assert s.lookup([keys[5]] + keys) == 0
    assert list(s.tiers[0].iter_free_slots()) == order
    assert s.metrics.hits == {} and s.metrics.misses == 0


def test_promotion_inclusive_keeps_lower_copy():
    s = two_cpu(top=2, bottom=8)
    keys, data = blocks(range(4))
    s.put(keys, data)  # 0,1 demoted below; 2,3 on top
    s.flush(0)         # 2,3 copied below too: a dirty block never leaves in the plan that copies it
    assert s.tiers[1].lookup(keys[:2]) == 2 and s.tiers[0].lookup(keys[2:]) == 2
    out = [torch.empty(BB, dtype=torch.uint8) for _ in range(2)]
    assert s.get(keys[:2], out) == 2
    assert s.metrics.hits["warm"] == 2 and s.metrics.promoted["hot"] == 2
    assert keys[0] in s.tiers[0] and keys[1] in s.tiers[0]
    assert keys[0] in s.tiers[1] and keys[1] in s.tiers[1]  # inclusive
    # the blocks pushed out of the top by the promotion went down, none was lost
    assert s.lookup(keys) == 4


def test_promotion_exclusive_moves():
    s = two_cpu(top=2, bottom=8, promotion="exclusive")
    keys, data = blocks(range(4))
    s.put(keys, data)
    s.flush(0)
    out = [torch.empty(BB, dtype=torch.uint8) for _ in range(2)]
    assert s.get(keys[:2], out) == 2
    assert keys[0] not in s.tiers[1] and keys[0] in s.tiers[0]
    assert s.lookup(keys) == 4
    for o, d in zip(out, data):
        assert torch.equal(o, d)


def test_capacity_bound_drops_oldest():
    s = two_cpu(top=2, bottom=3)
    keys, data = blocks(range(8))
    s.put(keys, data)
    assert sum(t.num_resident for t in s.tiers) == 5
    assert s.metrics.evicted["warm"] == 3
    assert s.lookup(keys[:3]) == 0  # the LRU ones left the hierarchy
    assert all(k in s.tiers[0] or k in s.tiers[1] for k in keys[3:])


def test_leases_pin_and_release():
    s = two_cpu(top=2, bottom=2)
    keys, data = blocks(range(4))
    s.put(keys, data)
    lease = s.plan("r1", keys)
    assert lease.num_blocks == 4
    again = s.plan("r1", keys)
    assert again is lease
    assert all(t.get_block(t.find(k)).ref_cnt == 1 for t in s.tiers for k in keys if k in t)
    # everything is pinned: new blocks cannot push leased blocks out
    k2, d2 = blocks(range(10, 14))
    assert s.put(k2, d2) == 0
    assert s.metrics.dropped_full["hot"] == 4
    assert s.lookup(keys) == 4
    s.commit("r1", 2)
    assert s.leases.pinned() == 2
    assert len(s.leases) == 1
    assert s.stats()["leases"] == 1
    s.commit("r0-unknown", 3)  # not ours: ignored
    s.release("r1")
    assert s.leases.pinned() == 0 and len(s.leases) == 0
    assert all(t.get_block(t.find(k)).ref_cnt == 0 for t in s.tiers for k in keys if k in t)
    assert s.put(k2, d2) == 4


def test_lease_expiry():
    s = two_cpu()
    now = [0.0]
    s.leases.clock = lambda: now[0]
    keys, data = blocks(range(3))
    s.put(keys, data)
    s.plan("r", keys)
    now[0] = s.leases.timeout_s + 1
    assert s.leases.expire() == ["r"]
    assert s.leases.pinned() == 0 and s.leases.expired == 1


class LeaseMachine(RuleBasedStateMachine):
    """No leased block is ever evicted; no pin survives once every request has ended."""

    def __init__(self):
        super().__init__()
        self.s = two_cpu(top=3, bottom=5, with_data=False)
        self.next_key = 0
        self.live: dict[str, list[bytes]] = {}

    @rule(n=st.integers(1, 6))
    def put(self, n):
        keys = [block_key(7, self.next_key + i) for i in range(n)]
        self.next_key += n
        self.s.put(keys)

    @rule(req=st.sampled_from(["a", "b", "c"]), lo=st.integers(0, 40), n=st.integers(1, 6))
    def plan(self, req, lo, n):
        keys = [block_key(7, i) for i in range(lo, lo + n)]
        lease = self.s.plan(req, keys)
        self.live[req] = list(lease.keys)[:lease.num_blocks]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def commit(self, data):
        req = data.draw(st.sampled_from(sorted(self.live)))
        n = data.draw(st.integers(0, 6))
        lease = self.s.commit(req, n)
        if lease is None:
            self.live.pop(req)
        else:
            self.live[req] = self.live[req][:lease.num_blocks]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data):
        req = data.draw(st.sampled_from(sorted(self.live)))
        self.s.release(req)
        self.live.pop(req)

    @invariant()
    def leased_blocks_stay(self):
        for keys in self.live.values():
            for k in keys:
                assert any(k in t for t in self.s.tiers), "a leased block was evicted"

    @invariant()
    def pins_match_leases(self):
        pinned = sum(t.get_block(s).ref_cnt for t in self.s.tiers for s in range(t.capacity_blocks)
                     if t.get_block(s).block_hash is not None)
        assert pinned == self.s.leases.pinned() == sum(len(v) for v in self.live.values())

    def teardown(self):
        for r in list(self.live):
            self.s.release(r)
        assert self.s.leases.pinned() == 0
        assert all(t.get_block(s).ref_cnt == 0 for t in self.s.tiers for s in range(t.capacity_blocks))


TestLeaseMachine = LeaseMachine.TestCase
TestLeaseMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
