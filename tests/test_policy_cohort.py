"""cohort eviction: walk properties (hypothesis) and exact small cases."""

from __future__ import annotations

import zlib

from hypothesis import given, settings, strategies as st

from kvtier.keys import make_key
from kvtier.policies import EVICTION, RequestInfo

CAP = 12


def _key(i: int) -> bytes:
    return make_key(i)


ops = st.lists(st.one_of(
    st.tuples(st.just("insert"), st.lists(st.integers(0, 40), min_size=1, max_size=5), st.integers(0, 600),
              st.integers(0, 3), st.integers(0, 400)),
    st.tuples(st.just("hit"), st.lists(st.integers(0, CAP - 1), min_size=1, max_size=4), st.just(0),
              st.just(0), st.just(0)),
    st.tuples(st.just("remove"), st.integers(0, CAP - 1), st.just(0), st.just(0), st.just(0)),
    st.tuples(st.just("victims"), st.integers(-1, CAP - 1), st.integers(0, CAP + 2), st.just(0), st.just(0)),
), max_size=80)


@settings(max_examples=150, deadline=None)
@given(seq=ops, levels=st.integers(1, 4), sample=st.sampled_from([0.0, 0.5, 1.0]),
       ghost=st.sampled_from([0.0, 1.0, 4.0]), short=st.sampled_from([0, 200]))
def test_victims_each_resident_once_and_resume(seq, levels, sample, ghost, short):
    pol = EVICTION.get("cohort")(CAP, levels=levels, sample=sample, ghost_ratio=ghost, short_output=short)
    resident: dict[int, bytes] = {}
    free = list(range(CAP))
    for op, a, b, hb, out in seq:
        if op == "insert":
            ids = [x for x in dict.fromkeys(a) if _key(x) not in resident.values()][:len(free)]
            if not ids:
                continue
            slots = [free.pop() for _ in ids]
            keys = [_key(x) for x in ids]
            # a chain whose first `hb` blocks are resident and already hit
            prefix = list(resident.values())[:hb]
            chain = prefix + keys
            pol.on_insert(slots, keys, RequestInfo(chain, len(prefix), len(prefix), b, 64, 0.0, None, out))
            resident.update(zip(slots, keys))
        elif op == "hit":
            slots = [s for s in dict.fromkeys(a) if s in resident]
            if slots:
                keys = [resident[s] for s in slots]
                pol.on_hit(slots, RequestInfo(keys, 0, len(keys), 64 * len(keys), 64, 0.0))
        elif op == "remove":
            if a in resident:
                pol.on_remove(a, resident.pop(a))
                free.append(a)
        else:
            full = list(pol.victims(None))
            assert len(full) == len(set(full))
            assert sorted(full) == sorted(resident)
            after = a if a >= 0 else None
            part = list(pol.victims(after))
            assert len(part) == len(set(part)) and set(part) <= set(resident)
            if after is not None and after in resident:
                assert part == full[full.index(after) + 1:]      # resume after `after`
            it = pol.victims(None)
            for _ in range(min(b, len(resident))):
                s = next(it)
                assert s in resident                               # never a removed slot
                pol.on_remove(s, resident.pop(s))
                free.append(s)
            assert sorted(pol.victims(None)) == sorted(resident)
    assert sorted(pol.victims(None)) == sorted(resident)


def _sampled(key: bytes, share: float) -> bool:
    return zlib.crc32(key) < int(share * 4294967296.0)


def test_partial_first_then_leaf_first():
    pol = EVICTION.get("cohort")(8)
    keys = [_key(i) for i in range(4)]
    pol.on_insert([0, 1, 2, 3], keys, RequestInfo(keys, 0, 0, 3 * 64 + 10, 64, 0.0))
    assert list(pol.victims()) == [3, 2, 1, 0]   # doomed partial block, then deepest first


def test_unsampled_conversation_leaves_before_sampled():
    pol = EVICTION.get("cohort")(8, sample=0.5)
    roots = [i for i in range(100, 200)]
    s_root = next(i for i in roots if _sampled(_key(i), 0.5))
    u_root = next(i for i in roots if not _sampled(_key(i), 0.5))
    ks = [_key(s_root), _key(s_root + 1000)]
    ku = [_key(u_root), _key(u_root + 1000)]
    pol.on_insert([0, 1], ks, RequestInfo(ks, 0, 0, 128, 64, 0.0))   # sampled, inserted first
    pol.on_insert([2, 3], ku, RequestInfo(ku, 0, 0, 128, 64, 1.0))   # unsampled, newer
    assert list(pol.victims()) == [3, 2, 1, 0]
    # a continuation of >= warm_hit cached blocks is sampled whatever its hash
    kc = ku + [_key(u_root + 2000)]
    pol.on_insert([4], kc[2:], RequestInfo(kc, 2, 2, 192, 64, 2.0))
    assert list(pol.victims()) == [3, 2, 1, 0, 4]


def test_hit_protects_and_ghost_readmits_protected():
    pol = EVICTION.get("cohort")(4, sample=1.0, ghost_ratio=2)
    k = [_key(i) for i in range(3)]
    pol.on_insert([0, 1, 2], k, RequestInfo(k, 0, 0, 192, 64, 0.0))
    pol.on_hit([0], RequestInfo(k[:1], 0, 1, 64, 64, 1.0))
    assert list(pol.victims()) == [2, 1, 0]          # 0 is protected, after the cold ones
    pol.on_remove(2, k[2])                             # evicted from sampled cold -> ghost
    assert k[2] in pol.ghost
    k3 = [_key(9)]
    pol.on_insert([3], k3, RequestInfo(k3, 0, 0, 64, 64, 2.0))
    pol.on_insert([2], [k[2]], RequestInfo(k, 2, 2, 192, 64, 3.0))   # comes back: protected
    assert list(pol.victims()) == [1, 3, 0, 2]        # cold in insertion order, then protected


def test_short_output_promotes_cached_prefix():
    pol = EVICTION.get("cohort")(8, sample=1.0, levels=3, short_output=100)
    k = [_key(i) for i in range(3)]
    pol.on_insert([0, 1, 2], k, RequestInfo(k, 0, 0, 192, 64, 0.0, None, 500))
    pol.on_hit([0, 1, 2], RequestInfo(k, 0, 3, 192, 64, 1.0))      # level 1 (hits stop below top)
    k2 = k + [_key(7)]
    pol.on_insert([3], k2[3:], RequestInfo(k2, 3, 3, 256, 64, 2.0, None, 20))  # short answer
    order = list(pol.victims())
    # 3 is new (cold); 0 (root) stays at level 1; 1 and 2 moved to the top level
    assert order == [3, 0, 2, 1]
