"""Scheduler side (control plane) of the connector, driven without vLLM's engine."""

from __future__ import annotations

import os
import sys

from dataclasses import dataclass, field

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvtier.connector.metadata import KVTierWorkerMeta
from kvtier.policies import EVICTION
from kvtier.tiers.base import SlotTier, RESIDENT

sys.path.insert(0, os.path.dirname(__file__))
from parts_util import scheduler  # noqa: E402

BT = 4  # tokens per block


@dataclass
class Req:
    request_id: str
    tokens: list[int]
    block_hashes: list[bytes] = field(default_factory=list)

    def __post_init__(self):
        h = b""
        for i in range(len(self.tokens) // BT):
            h = bytes((hash((h, tuple(self.tokens[i * BT:(i + 1) * BT]))) & ((1 << 64) - 1)).to_bytes(8, "big"))
            self.block_hashes.append(h)

    @property
    def num_tokens(self):
        return len(self.tokens)


def make(cap=8, store=True):
    tier = SlotTier("cpu", cap, 64, EVICTION.get("lru")(cap))
    return scheduler([tier], BT, store=store), tier


def run_step(s, scheduled, ok=True):
    """Build the plan, pretend the worker did it, feed the result back."""
    meta = s.build_meta([(q, n, None if ids is None else [ids]) for q, n, ids in scheduled])
    wm = KVTierWorkerMeta(stored={op.op_id: [ok] * len(op.slots) for op in meta.stores},
                          loaded={op.req_id: ok for op in meta.loads})
    s.on_worker_meta(wm)
    return meta


def store_request(s, r, base=100):
    ids = list(range(base, base + len(r.block_hashes) + 1))
    s.lookup(r, 0)
    s.on_alloc(r, [ids], 0)
    run_step(s, [(r.request_id, r.num_tokens, ids)])
    s.on_finished(r.request_id)


def test_store_then_hit_exact_counts():
    s, tier = make()
    r = Req("a", list(range(18)))  # 4 full blocks + 2 tokens
    store_request(s, r)
    assert tier.num_resident == 4
    r2 = Req("b", list(range(18)))
    assert s.lookup(r2, 0) == 16
    assert s.lookup(r2, 0) == 16             # idempotent: no second pin
    assert s.leases.pinned() == 4 and sum(tier._ref) == 4
    s.on_alloc(r2, [[7, 8, 9, 10, 11]], 16)
    meta = run_step(s, [("b", 18, [7, 8, 9, 10, 11])])
    assert [(op.slots, op.block_ids) for op in meta.loads] == [([tier.find(k) for k in s._reqs["b"].keys[:4]],
                                                               [7, 8, 9, 10])]
    assert not meta.stores                   # loaded blocks are not stored again
    assert s.leases.pinned() == 0 and sum(tier._ref) == 0
    assert s.totals["hit_tokens"] == 16
    s.on_finished("b")


def test_leaves_one_token_to_compute():
    s, _ = make()
    r = Req("a", list(range(16)))  # exactly 4 blocks
    store_request(s, r)
    assert s.lookup(Req("b", list(range(16))), 0) == 12


def test_partial_accept_and_not_chosen():
    s, tier = make()
    store_request(s, Req("a", list(range(17))))
    r = Req("b", list(range(17)))
    assert s.lookup(r, 0) == 16
    s.on_alloc(r, [list(range(5))], 8)         # vLLM accepted 2 of 4 blocks
    assert s.leases.pinned() == 2
    run_step(s, [])
    assert s.leases.pinned() == 0
    r3 = Req("c", list(range(17)))
    assert s.lookup(r3, 0) == 16
    s.on_alloc(r3, [list(range(5))], 0)        # MultiConnector chose the sibling
    assert s.leases.pinned() == 0 and sum(tier._ref) == 0
    assert s.totals["n_leases_not_chosen"] == 1


def test_an_allocation_short_of_the_hit_is_recomputed():
    """vLLM accepted a 4-block hit but its block table holds 2 blocks: nothing loads, the accepted
    blocks are load errors vLLM recomputes, the lease goes (was: the lease went and vLLM was told
    nothing, so it took the blocks as computed)."""
    s, tier = make()
    store_request(s, Req("a", list(range(17))))
    r = Req("b", list(range(17)))
    assert s.lookup(r, 0) == 16
    s.on_alloc(r, [[7, 8]], 16)
    meta = s.build_meta([])
    assert not meta.loads and meta.failed_loads == {"b": [7, 8]}
    assert s.leases.pinned() == 0 and sum(tier._ref) == 0
    assert s.totals["alloc_mismatch"] == 1


def test_lookup_after_local_hit_starts_there():
    s, _ = make()
    store_request(s, Req("a", list(range(17))))
    r = Req("b", list(range(17)))
    assert s.lookup(r, 8) == 8               # blocks 2..3 beyond the 2 local ones
    assert s.leases.leases["b"].start == 2


def test_failed_store_is_not_visible():
    s, tier = make()
    r = Req("a", list(range(9)))
    s.lookup(r, 0)
    s.on_alloc(r, [[1, 2, 3]], 0)
    run_step(s, [("a", 9, [1, 2, 3])], ok=False)
    assert tier.num_resident == 0 and tier.num_free_slots == tier.capacity_blocks
    assert s.totals["store_failed_blocks.cpu"] == 2


def test_eviction_skips_leased_blocks():
    s, tier = make(cap=4)
    store_request(s, Req("a", list(range(17))))                       # fills the tier
    holder = Req("h", list(range(17)))
    assert s.lookup(holder, 0) == 16                                   # leases all 4
    other = Req("o", [1000 + i for i in range(17)])
    s.lookup(other, 0)
    s.on_alloc(other, [list(range(50, 55))], 0)
    meta = run_step(s, [("o", 17, list(range(50, 55)))])
    assert not meta.stores                                             # nothing evictable
    assert s.totals.get("store_dropped_blocks.cpu", 0) == 0           # offered again while "o" runs
    assert all(tier.find(k) is not None for k in s._reqs["h"].keys[:4])
    s.on_finished("h")
    s.on_finished("o")                                                 # finished before a step found room
    assert s.totals["store_dropped_blocks.cpu"] == 4
    other2 = Req("o2", [1000 + i for i in range(17)])
    s.lookup(other2, 0)
    s.on_alloc(other2, [list(range(60, 65))], 0)
    meta = run_step(s, [("o2", 17, list(range(60, 65)))])
    assert sum(len(op.slots) for op in meta.stores) == 4              # LRU victims now free


def test_blocks_without_room_are_stored_in_a_later_step():
    """Blocks the top tier has no room for in their step (every slot pinned) are offered again in
    the request's next step and stored once a slot frees, into the same vLLM blocks; none dropped."""
    s, tier = make(cap=4)
    store_request(s, Req("a", list(range(17))))
    holder = Req("h", list(range(17)))
    assert s.lookup(holder, 0) == 16                                   # pins every slot
    other = Req("o", [1000 + i for i in range(17)])
    ids = list(range(50, 55))
    s.lookup(other, 0)
    s.on_alloc(other, [ids], 0)
    assert not run_step(s, [("o", 17, ids)]).stores
    s.on_finished("h")                                                 # its lease goes: room
    meta = run_step(s, [("o", 18, ids)])                               # o's next (decode) step
    assert [op.slots and op.block_ids for op in meta.stores] == [[50, 51, 52, 53]]
    assert [tier.find(k) is not None for k in s._reqs["o"].keys[:4]] == [True] * 4
    assert not run_step(s, [("o", 19, ids)]).stores                   # stored once
    s.on_finished("o")
    assert s.totals.get("store_dropped_blocks.cpu", 0) == 0
    assert s.lookup(Req("o2", [1000 + i for i in range(17)]), 0) == 16


def test_store_off_never_plans():
    s, tier = make(store=False)
    r = Req("a", list(range(17)))
    s.lookup(r, 0)
    s.on_alloc(r, [list(range(5))], 0)
    assert not run_step(s, [("a", 17, list(range(5)))]).stores


# ---- state machine: lookup / alloc / abort / preempt / finish / step -----------------------

PREFIXES = [list(range(p * 100, p * 100 + 40)) for p in range(3)]


class LeaseMachine(RuleBasedStateMachine):
    @initialize(cap=st.integers(2, 10))
    def setup(self, cap):
        self.s, self.tier = make(cap=cap)
        self.live: dict[str, Req] = {}
        self.alloc: dict[str, list[int]] = {}
        self.n = 0
        self.next_block = 1
        self.outstanding = []

    @rule(p=st.integers(0, 2), length=st.integers(1, 40))
    def arrive(self, p, length):
        self.n += 1
        rid = f"r{self.n}"
        self.live[rid] = Req(rid, PREFIXES[p][:length])

    def _pick(self, data):
        return data.draw(st.sampled_from(sorted(self.live)))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), local=st.integers(0, 3))
    def lookup(self, data, local):
        rid = self._pick(data)
        r = self.live[rid]
        nc = min(local, len(r.block_hashes)) * BT
        n = self.s.lookup(r, nc)
        assert n % BT == 0 and nc + n < r.num_tokens or n == 0
        lease = self.s.leases.leases.get(rid)
        if lease is not None:  # every leased block is resident and pinned
            for t, slot in lease.blocks:
                assert self.tier._state[slot] == RESIDENT and self.tier._ref[slot] >= 1

    @precondition(lambda self: self.live)
    @rule(data=st.data(), accept=st.booleans())
    def allocate(self, data, accept):
        rid = self._pick(data)
        r = self.live[rid]
        lease = self.s.leases.leases.get(rid)
        nblocks = (r.num_tokens + BT - 1) // BT
        ids = list(range(self.next_block, self.next_block + nblocks))
        self.next_block += nblocks
        self.alloc[rid] = ids
        n_ext = lease.num_blocks * BT if (accept and lease is not None) else 0
        if lease is not None and lease.start * BT + n_ext >= r.num_tokens:
            n_ext = 0
        self.s.on_alloc(r, [ids], n_ext)

    @rule(ok=st.booleans(), data=st.data())
    def step(self, ok, data):
        sched = [(rid, self.live[rid].num_tokens, [ids]) for rid, ids in self.alloc.items() if rid in self.live]
        run_step(self.s, sched, ok=ok)

    @rule()
    def plan_only(self):
        """Build a plan whose worker results arrive later (stores stay pending meanwhile)."""
        sched = [(rid, self.live[rid].num_tokens, [ids]) for rid, ids in self.alloc.items() if rid in self.live]
        self.outstanding.append(self.s.build_meta(sched))

    @precondition(lambda self: self.outstanding)
    @rule(ok=st.booleans())
    def deliver(self, ok):
        meta = self.outstanding.pop(0)
        self.s.on_worker_meta(KVTierWorkerMeta(stored={op.op_id: [ok] * len(op.slots) for op in meta.stores},
                                               loaded={op.req_id: ok for op in meta.loads}))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def preempt(self, data):
        rid = self._pick(data)
        self.s.on_preempted(rid)
        self.alloc.pop(rid, None)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish_or_abort(self, data):
        rid = self._pick(data)
        assert self.s.on_finished(rid) == (False, None)
        self.live.pop(rid)
        self.alloc.pop(rid, None)

    @invariant()
    def pins_match_leases(self):
        if not hasattr(self, "s"):
            return
        leased = [0] * self.tier.capacity_blocks
        for lease in self.s.leases.leases.values():
            for _, slot in lease.blocks:
                leased[slot] += 1
        for slot in range(self.tier.capacity_blocks):
            pending = 1 if slot in self.tier._pending else 0
            assert self.tier._ref[slot] == leased[slot] + pending, slot
        assert set(self.s.leases.leases) <= set(self.live)

    def teardown(self):
        if not hasattr(self, "s"):
            return
        for rid in list(self.live):
            self.s.on_finished(rid)
        while self.outstanding:
            self.deliver(True)
        run_step(self.s, [])
        assert self.s.leases.pinned() == 0
        assert sum(self.tier._ref) == 0


TestLeaseMachine = LeaseMachine.TestCase
TestLeaseMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_policies_see_vllm_request_ids():
    """A policy's per-request state is keyed by vLLM's request id: key lists are freed when a
    request finishes, so an identity built on them can be reused by the next request."""
    seen = []

    class Recording(EVICTION.get("lru")):
        def on_insert(self, slots, keys, info):
            seen.append(info.request_id)
            super().on_insert(slots, keys, info)

    tier = SlotTier("cpu", 8, 64, Recording(8))
    s = scheduler([tier], BT)
    store_request(s, Req("a", list(range(9))))
    store_request(s, Req("b", list(range(100, 109))))
    assert seen == ["a", "b"]


@dataclass
class LoraReq(Req):
    lora_request: object = None


def test_lora_requests_pass_through(caplog):
    """A request with a LoRA adapter is neither looked up nor stored (vLLM's hashes name the
    adapter, not its weights), counted once per request, one line once; the base model's are."""
    s, tier = make()
    store_request(s, Req("base", list(range(18))))
    assert tier.num_resident == 4
    for rid in ("l1", "l2"):
        r = LoraReq(rid, list(range(18)), lora_request=type("LoRARequest", (), {"lora_name": "ad"})())
        assert s.lookup(r, 0) == 0 and s.lookup(r, 0) == 0       # the base model's blocks are there
        s.on_alloc(r, [list(range(200, 205))], 0)
        meta = run_step(s, [(rid, r.num_tokens, list(range(200, 205)))])
        assert not meta.stores and not meta.loads
        s.on_finished(rid)
    assert tier.num_resident == 4 and s.leases.pinned() == 0
    assert s.totals["lora_passthrough"] == 2 and s.totals.get("hit_tokens", 0) == 0
    assert caplog.text.count("LoRA adapter") == 1
    assert s.lookup(Req("base2", list(range(18))), 0) == 16
