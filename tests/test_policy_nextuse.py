"""nextuse eviction: walk properties (hypothesis) and exact small cases."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from kvtier.keys import make_key
from kvtier.policies import EVICTION, RequestInfo

CAP = 12


def _key(i: int) -> bytes:
    return make_key(i)


ops = st.lists(st.one_of(
    st.tuples(st.just("insert"), st.lists(st.integers(0, 40), min_size=1, max_size=5), st.integers(0, 600)),
    st.tuples(st.just("hit"), st.lists(st.integers(0, CAP - 1), min_size=1, max_size=4), st.just(0)),
    st.tuples(st.just("remove"), st.integers(0, CAP - 1), st.just(0)),
    st.tuples(st.just("victims"), st.integers(-1, CAP - 1), st.integers(0, CAP + 2)),
), max_size=80)


@settings(max_examples=150, deadline=None)
@given(seq=ops, classes=st.integers(1, 5), ghost=st.sampled_from([0.5, 1.0, 4.0]),
       lifetimes=st.sampled_from(["horizon", "observed"]))
def test_victims_each_resident_once_and_resume(seq, classes, ghost, lifetimes):
    pol = EVICTION.get("nextuse")(CAP, classes=classes, ghost_ratio=ghost, lifetimes=lifetimes)
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
        elif op == "remove":
            if a in resident:
                pol.on_remove(a, resident.pop(a))
                free.append(a)
        else:
            full = list(pol.victims(None))
            assert sorted(full) == sorted(resident)
            after = a if a >= 0 else None
            part = list(pol.victims(after))
            assert len(part) == len(set(part)) and set(part) <= set(resident)
            if after is not None and after in resident:
                # resume = the suffix of the full walk after `after`
                assert part == full[full.index(after) + 1:]
            it = pol.victims(None)
            for _ in range(min(b, len(resident))):
                s = next(it)
                pol.on_remove(s, resident.pop(s))
                free.append(s)
            assert sorted(pol.victims(None)) == sorted(resident)
    assert sorted(pol.victims(None)) == sorted(resident)


def test_partial_last_block_goes_first_and_leaf_first():
    pol = EVICTION.get("nextuse")(8)
    keys = [_key(i) for i in range(4)]
    # 3.5 blocks of 64 tokens: block 3 is partial
    pol.on_insert([0, 1, 2, 3], keys, RequestInfo(keys, 0, 0, 3 * 64 + 10, 64, 0.0))
    order = list(pol.victims())
    assert order[0] == 3               # doomed
    assert order[1:] == [2, 1, 0]      # deepest first


def test_continuation_gets_a_deeper_class_and_ghost_records_reuse():
    cap = 8
    pol = EVICTION.get("nextuse")(cap, classes=3, ghost_ratio=4)
    k1 = [_key(i) for i in range(2)]
    pol.on_insert([0, 1], k1, RequestInfo(k1, 0, 0, 128, 64, 0.0))      # turn 0, tip = block 1
    assert pol.cls[0] == 0 and pol.tip[1] == 0
    k2 = k1 + [_key(10), _key(11)]
    info = RequestInfo(k2, 0, 2, 256, 64, 1.0)
    pol.on_hit([0, 1], info)
    pol.on_insert([2, 3], k2[2:], RequestInfo(k2, 2, 2, 256, 64, 1.0))  # turn 1
    assert [pol.cls[s] for s in (2, 3)] == [1, 1]
    assert pol.tip[3] == 1 and pol.tip[1] == -1                          # old tip consumed
    assert sum(pol.R[0]) == 2                                            # two reuses of turn-0 blocks
    # evict block 3 to the ghost, bring it back: a reuse in its class
    pol.on_remove(3, k2[3])
    assert k2[3] in pol.ghost
    pol.on_insert([3], [k2[3]], RequestInfo(k2, 3, 3, 256, 64, 2.0))
    assert k2[3] not in pol.ghost and sum(pol.R[1]) == 1
    assert sorted(pol.victims()) == [0, 1, 2, 3]


def test_old_blocks_move_to_older_buckets():
    cap = 16
    pol = EVICTION.get("nextuse")(cap, classes=1, ghost_ratio=2)
    pol.on_insert([0], [_key(0)], RequestInfo())
    for i in range(1, 12):
        pol.on_insert([i], [_key(i)], RequestInfo())
    # block 0 has age 11 blocks: bucket of [8, 16)
    cell = pol.member[0] - 1
    assert cell == 1 + pol._bucket(11)
    assert pol._bucket(11) > pol._bucket(0)
