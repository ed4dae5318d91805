"""Eviction / admission / promotion policies: properties and exact small cases."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from kvtier.core.keys import make_key
from kvtier.policies import ADMISSION, EVICTION, PROMOTION, RETIRED, RequestInfo
from kvtier.tiers.base import SlotTier

POLICIES = ["lru", "vllm_lru", "arc", "s3fifo"]
CAP = 12

def op_lists(max_size: int):
    """Random insert / hit / remove / walk sequences over a CAP-slot policy."""
    return st.lists(st.one_of(
        st.tuples(st.just("insert"), st.lists(st.integers(0, 40), min_size=1, max_size=5), st.integers(0, 600)),
        st.tuples(st.just("hit"), st.lists(st.integers(0, CAP - 1), min_size=1, max_size=4), st.integers(0, 1)),
        st.tuples(st.just("remove"), st.lists(st.integers(0, CAP - 1), min_size=1, max_size=4), st.integers(0, 1)),
        st.tuples(st.just("victims"), st.integers(-1, CAP - 1), st.integers(0, CAP + 2)),
    ), max_size=max_size)


def _key(i: int) -> bytes:
    return make_key(i)


def drive(pol, seq, resume_is_suffix: bool = False) -> None:
    """Run `seq` on `pol` the way a tier does, checking after every walk that the victims are
    each resident slot exactly once (and, if `resume_is_suffix`, that a resumed walk is the
    suffix of the full walk after its start)."""
    resident: dict[int, bytes] = {}
    free = list(range(CAP))
    for op, a, b in seq:
        if op == "insert":
            ids = [x for x in dict.fromkeys(a) if _key(x) not in resident.values()][:len(free)]
            if not ids:
                continue
            slots = [free.pop() for _ in ids]
            keys = [_key(x) for x in ids]
            pol.on_insert(slots, keys, RequestInfo(keys, 0, 0, b, 64, 0.0))
            resident.update(zip(slots, keys))
        elif op == "hit":
            slots = [s for s in dict.fromkeys(a) if s in resident]
            if slots:
                keys = [resident[s] for s in slots]
                pol.on_hit(slots, RequestInfo(keys, 0, len(keys), 64 * len(keys), 64, 0.0) if b else RequestInfo())
        elif op == "remove":  # b: one on_remove_many batch (a tier's evict), else on_remove each
            slots = [x for x in dict.fromkeys(a) if x in resident]
            keys = [resident.pop(x) for x in slots]
            if b:
                pol.on_remove_many(slots, keys)
            else:
                for x, k in zip(slots, keys):
                    pol.on_remove(x, k)
            free.extend(slots)
        else:
            full = list(pol.victims(None))
            assert sorted(full) == sorted(resident), "victims(None) must yield every resident slot once"
            after = a if a >= 0 else None
            part = list(pol.victims(after))
            assert len(part) == len(set(part))
            assert set(part) <= set(resident)
            if after is not None and after in resident:
                assert after not in part
                if resume_is_suffix:
                    assert part == full[full.index(after) + 1:]
            # evict the first few victims the way a tier does: unlink while walking, or (odd b)
            # take them as a batch (free_slots) and remove them in one call
            k = min(b, len(resident))
            if b % 2:
                head = list(pol.victims(None))[:k]  # a fresh walk (s3fifo's walks move blocks lazily)
                out = pol.take_victims(k, [0] * CAP)
                assert out == head, "take_victims must be the head of victims(None)"
                pol.on_remove_many(out, [resident.pop(s) for s in out])
                free.extend(out)
            else:
                it = pol.victims(None)
                for _ in range(k):
                    s = next(it)
                    pol.on_remove(s, resident.pop(s))
                    free.append(s)
            assert sorted(pol.victims(None)) == sorted(resident)
    assert sorted(pol.victims(None)) == sorted(resident)


@pytest.mark.parametrize("name", POLICIES)
@settings(max_examples=60, deadline=None)
@given(seq=op_lists(60))
def test_victims_yield_each_resident_exactly_once(name, seq):
    drive(EVICTION.get(name)(CAP), seq)


@pytest.mark.parametrize("name", ["lru", "vllm_lru"])
def test_list_policies_resume_is_a_suffix(name):
    pol = EVICTION.get(name)(8)
    keys = [_key(i) for i in range(6)]
    pol.on_insert(list(range(6)), keys, RequestInfo())
    order = list(pol.victims())
    for i, s in enumerate(order):
        assert list(pol.victims(s)) == order[i + 1:]
    pol.on_remove(order[2], keys[order[2]])
    assert list(pol.victims(order[2])) == [s for s in order if s != order[2]]


def test_lru_order():
    """A call's blocks go tail-first (deepest leaves first); a hit moves them, tail-first, to the end."""
    pol = EVICTION.get("lru")(4)
    pol.on_insert([0, 1, 2], [_key(i) for i in range(3)])
    assert list(pol.victims()) == [2, 1, 0]
    pol.on_hit([2])
    assert list(pol.victims()) == [1, 0, 2]
    pol.on_insert([3], [_key(3)])
    assert list(pol.victims(0)) == [2, 3]
    chain = EVICTION.get("lru")(4, order="chain")
    chain.on_insert([0, 1, 2], [_key(i) for i in range(3)])
    assert list(chain.victims()) == [0, 1, 2]


def _req(n, start=0, hit=0, now=0.0):
    keys = [_key(100 + i) for i in range(n)]
    return keys, RequestInfo(keys, start, hit, n * 64, 64, now)


def test_vllm_lru_frees_a_request_tail_first_new_blocks_before_its_prefix():
    """vLLM frees reversed(request blocks): hit prefix p0 p1 then new n2 n3 leave as n3 n2 p1 p0."""
    pol = EVICTION.get("vllm_lru")(8)
    old = [_key(i) for i in range(2)]
    pol.on_insert([6, 7], old, RequestInfo(old, 0, 0, 128, 64, 0.0))     # an older request
    keys, info = _req(4, now=1.0)
    pol.on_insert([0, 1], keys[:2], RequestInfo(keys[:2], 0, 0, 128, 64, 0.5))  # the earlier turn
    pol.on_hit([0, 1], info)
    pol.on_insert([2, 3], keys[2:], RequestInfo(keys, 2, 2, 256, 64, 1.0))
    assert list(pol.victims()) == [7, 6, 3, 2, 1, 0]
    # two new runs of one request (a gap at position 4): the deeper run leaves first
    keys2 = [_key(200 + i) for i in range(6)]
    pol2 = EVICTION.get("vllm_lru")(8)
    pol2.on_insert([0, 1, 2, 3], keys2[:4], RequestInfo(keys2, 0, 0, 384, 64, 2.0))
    pol2.on_insert([5], keys2[5:], RequestInfo(keys2, 5, 0, 384, 64, 2.0))
    assert list(pol2.victims()) == [5, 3, 2, 1, 0]
    # plain lru is the same policy
    assert EVICTION.get("lru")(8)._order == "vllm"
    # with a request_id the keys list need not be the same object across the calls
    pol3 = EVICTION.get("vllm_lru")(8)
    k3 = [_key(300 + i) for i in range(4)]
    pol3.on_insert([0, 1], k3[:2], RequestInfo(list(k3[:2]), 0, 0, 128, 64, 0.0, "a"))
    pol3.on_hit([0, 1], RequestInfo(list(k3), 0, 2, 256, 64, 1.0, "b"))
    pol3.on_insert([2, 3], k3[2:], RequestInfo(list(k3), 2, 2, 256, 64, 1.0, "b"))
    assert list(pol3.victims()) == [3, 2, 1, 0]


def test_vllm_lru_request_longer_than_the_cache_keeps_its_prefix():
    """A 10-block request stored in runs of 2 (evicting before each run, as the stack's put does)
    into a 4-block tier: under vllm_lru each new run goes before the request's older blocks, so
    the next run evicts the deepest and blocks 0, 1 stay (the next turn hits 2); head-first
    (order="chain") LRU evicts the prefix first and the next turn hits nothing. The simulator,
    which stores only what fits, keeps blocks 0..3."""
    from kvtier.offline.sim import simulate
    from kvtier.offline.trace import Request
    a = Request(0.0, 640, 1, tuple(range(10)))
    b = Request(1.0, 704, 1, tuple(range(11)))
    # one request at a time, stored run by run as the stack's put does for a long prompt
    pol = EVICTION.get("vllm_lru")(4)
    tier = SlotTier("t", 4, 0, pol)
    keys = [_key(h) for h in a.hash_ids]
    for lo in range(0, 10, 2):
        run = keys[lo:lo + 2]
        need = len(run) - tier.num_free_slots
        if need > 0:
            tier.evict(tier.free_slots(need))
        tier.commit(tier.allocate(run), RequestInfo(keys, lo, 0, 640, 64, 0.0))
    assert tier.lookup([_key(h) for h in b.hash_ids]) == 2
    chain = SlotTier("t", 4, 0, EVICTION.get("lru")(4, order="chain"))
    for lo in range(0, 10, 2):
        run = keys[lo:lo + 2]
        need = len(run) - chain.num_free_slots
        if need > 0:
            chain.evict(chain.free_slots(need))
        chain.commit(chain.allocate(run), RequestInfo(keys, lo, 0, 640, 64, 0.0))
    assert chain.lookup([_key(h) for h in b.hash_ids]) == 0
    assert simulate([a, b], 4, "vllm_lru", block_tokens=64)["hit_blocks"] == 4


def test_arc_moves_hits_to_t2_and_uses_ghosts():
    pol = EVICTION.get("arc")(4)
    pol.on_insert([0, 1, 2], [_key(i) for i in range(3)])
    pol.on_hit([1])
    assert 1 in pol.t2 and 0 in pol.t1
    # p == 0: T1 goes first (pushed tail-first: 2 before 0), then T2
    assert list(pol.victims()) == [2, 0, 1]
    pol.on_remove(0, _key(0))  # -> ghost B1
    assert _key(0) in pol.b1
    pol.on_insert([0], [_key(0)])  # B1 ghost hit: p grows, block enters T2
    assert pol.p >= 1 and 0 in pol.t2
    assert list(pol.victims()) == [1, 0, 2] or list(pol.victims())[-1] in (0, 1, 2)
    assert sorted(pol.victims()) == [0, 1, 2]


def test_arc_respects_p():
    pol = EVICTION.get("arc")(4)
    pol.on_insert([0, 1], [_key(0), _key(1)])
    pol.on_hit([1])
    pol.p = 1.0  # T1 may keep one block: T2's head goes first
    assert list(pol.victims()) == [1, 0]
    assert list(pol.victims(1)) == [0]


def test_s3fifo_small_queue_and_second_chance():
    pol = EVICTION.get("s3fifo")(10, small_ratio=0.2)
    pol.on_insert(list(range(4)), [_key(i) for i in range(4)])  # pushed tail-first: S = 3 2 1 0
    pol.on_hit([3])
    v = pol.victims()
    assert next(v) == 2          # 3 was hit: promoted to main, 2 is the first victim
    assert 3 in pol.main
    pol.on_remove(1, _key(1))
    assert _key(1) in pol.ghost
    pol.on_insert([1], [_key(1)])  # ghost hit -> main
    assert 1 in pol.main
    assert sorted(pol.victims()) == [0, 1, 2, 3]


@settings(max_examples=40, deadline=None)
@given(seq=st.lists(st.tuples(st.lists(st.integers(0, 30), min_size=1, max_size=6, unique=True),
                              st.integers(0, 3)), max_size=40),
       name=st.sampled_from(POLICIES))
def test_slottier_never_yields_or_evicts_pinned(seq, name):
    cap = 8
    tier = SlotTier("t", cap, 0, EVICTION.get(name)(cap))
    pinned: list[int] = []
    for ids, npin in seq:
        keys = [_key(i) for i in ids if _key(i) not in tier][:cap]
        need = len(keys) - tier.num_free_slots
        if need > 0:
            vic = []
            for s in tier.iter_free_slots():
                assert tier.get_block(s).ref_cnt == 0
                vic.append(s)
                if len(vic) == need:
                    break
            for bv in tier.iter_free_blocks():
                assert bv.ref_cnt == 0 and bv.block_id not in pinned
            if len(vic) < need:
                keys = keys[:len(keys) - (need - len(vic))]
            tier.evict(vic)
        if keys:
            slots = tier.allocate(keys)
            tier.commit(slots)
            pin = slots[:npin]
            tier.touch(pin)
            pinned.extend(pin)
        if len(pinned) > 4:  # unpin the oldest
            tier.free_blocks(pinned[:2])
            pinned = pinned[2:]
        for s in pinned:
            with pytest.raises(ValueError):
                tier.evict([s])
        assert not set(pinned) & set(tier.iter_free_slots())


def test_admit_all():
    adm = ADMISSION.get("all")()
    assert adm.admit([_key(1), _key(2)]) == [True, True]


def test_second_hit_filter():
    adm = ADMISSION.get("second_hit")(history=1024)
    a, b = _key(1), _key(2)
    assert adm.admit([a, b]) == [False, False]
    assert adm.admit([a]) == [True]
    assert adm.admit([b, _key(3)]) == [True, False]


def test_second_hit_history_is_bounded_and_ages():
    adm = ADMISSION.get("second_hit")(history=64)
    sk = adm.sketch
    assert all(len(r) == 64 for r in sk.rows)
    for i in range(10 * 64 + 1):
        adm.admit([_key(i)])
    assert max(max(r) for r in sk.rows) <= sk.cap


def test_promotion():
    inc, exc, none = PROMOTION.get("inclusive")(), PROMOTION.get("exclusive")(), PROMOTION.get("none")()
    assert inc.inclusive and not exc.inclusive
    assert inc.target(2, 3) == 0 and exc.target(1, 3) == 0 and none.target(2, 3) is None
    assert inc.target(0, 3) is None
    with pytest.raises(ValueError):
        inc.target(3, 3)
    with pytest.raises(KeyError):
        EVICTION.get("nope")


@pytest.mark.parametrize("name", sorted(RETIRED))
def test_a_retired_policy_is_refused_with_what_to_use(name):
    reg = ADMISSION if RETIRED[name] == "all" else EVICTION
    assert name not in EVICTION.classes and name not in ADMISSION.classes
    with pytest.raises(KeyError, match=f"'{name}' was retired .* use '{RETIRED[name]}'"):
        reg.get(name)
    assert RETIRED[name] in reg.classes
