"""nextuse eviction: walk properties (hypothesis) and exact small cases."""

from __future__ import annotations

import os
import sys

from hypothesis import given, settings, strategies as st

from kvtier.policies import EVICTION, RequestInfo

sys.path.insert(0, os.path.dirname(__file__))
from test_policies import CAP, _key, drive, op_lists  # noqa: E402


@settings(max_examples=150, deadline=None)
@given(seq=op_lists(80), classes=st.integers(1, 5), ghost=st.sampled_from([0.5, 1.0, 4.0]),
       lifetimes=st.sampled_from(["horizon", "observed"]))
def test_victims_each_resident_once_and_resume(seq, classes, ghost, lifetimes):
    drive(EVICTION.get("nextuse")(CAP, classes=classes, ghost_ratio=ghost, lifetimes=lifetimes), seq,
          resume_is_suffix=True)


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


@settings(max_examples=60, deadline=None)
@given(seq=op_lists(60), classify=st.sampled_from(["max", "grid"]), request_order=st.booleans())
def test_knobs_keep_the_walk_properties(seq, classify, request_order):
    drive(EVICTION.get("nextuse")(CAP, classify=classify, request_order=request_order), seq,
          resume_is_suffix=True)


def test_request_order_new_blocks_leave_before_the_requests_prefix():
    """vLLM frees a request tail-first: after hit(prefix) + insert(new run), the new blocks are
    evicted before the prefix (without request_order the prefix, touched first, went first)."""
    for ro, expect in ((True, [3, 2, 1, 0]), (False, [1, 0, 3, 2])):
        pol = EVICTION.get("nextuse")(8, classes=1, request_order=ro)
        keys = [_key(i) for i in range(4)]
        pol.on_insert([0, 1], keys[:2], RequestInfo(keys[:2], 0, 0, 128, 64, 0.0))
        info = RequestInfo(keys, 0, 2, 256, 64, 1.0)
        pol.on_hit([0, 1], info)
        pol.on_insert([2, 3], keys[2:], RequestInfo(keys, 2, 2, 256, 64, 1.0))
        assert list(pol.victims()) == expect, ro
