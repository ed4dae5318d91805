"""Hybrid KV-cache groups (connector/groups.py): the hit length every group can serve, checked
against a brute force over every candidate length."""

from __future__ import annotations

import math

from hypothesis import given, settings, strategies as st

from kvtier.connector.groups import Group, GroupKind, hit_tokens, key_index


def brute(groups, present, local, num_tokens, num_hashes, hash_tokens):
    unit = 1
    for g in groups:
        unit = math.lcm(unit, g.block_tokens)
    cap = min(num_tokens - 1, num_hashes * hash_tokens) // unit * unit
    best = local
    for n in range(local + unit, cap + 1, unit):
        if all(present(g, i) for g in groups for i in g.needed(n, local)):
            best = n
    return best - local


groups_st = st.lists(st.sampled_from([
    Group(0, GroupKind.FULL, 16), Group(1, GroupKind.SLIDING, 16, window=40), Group(2, GroupKind.SLIDING, 16, window=16),
    Group(3, GroupKind.MAMBA, 16), Group(4, GroupKind.CHUNKED, 16, chunk=32), Group(5, GroupKind.FULL, 32),
    Group(6, GroupKind.SLIDING, 32, window=70, extra=5)]), min_size=1, max_size=3, unique_by=lambda g: g.gid)


@settings(max_examples=300, deadline=None)
@given(groups=groups_st, bits=st.lists(st.booleans(), min_size=64, max_size=64), local_blocks=st.integers(0, 3),
       num_tokens=st.integers(1, 400), num_hashes=st.integers(0, 24))
def test_hit_equals_the_brute_force(groups, bits, local_blocks, num_tokens, num_hashes):
    """Full groups stop at their longest present prefix; the other groups are checked at each
    candidate; the answer is the largest length every group can serve. (A full group's blocks
    past a gap are irrelevant: it needs the whole prefix, which the brute force checks too.)"""
    unit = 1
    for g in groups:
        unit = math.lcm(unit, g.block_tokens)
    local = local_blocks * unit
    present = lambda g, i: bits[(g.gid * 7 + i) % 64]  # noqa: E731
    got = hit_tokens(groups, present, local, num_tokens, num_hashes, 16)
    want = brute(groups, present, local, num_tokens, num_hashes, 16)
    # a full group is downward-closed, so the brute force's largest length is a prefix too, except
    # where a full group has a gap then present blocks: the brute force would skip the gap
    if any(g.kind is GroupKind.FULL for g in groups):
        fulls = [g for g in groups if g.kind is GroupKind.FULL]
        def ok(n):
            return all(present(g, i) for g in groups for i in g.needed(n, local)) and \
                all(all(present(g, i) for i in range(local // g.block_tokens, n // g.block_tokens)) for g in fulls)
        cap = min(num_tokens - 1, num_hashes * 16) // unit * unit
        want = max([n for n in range(local + unit, cap + 1, unit) if ok(n)] + [local]) - local
    assert got == want
    assert got % unit == 0 and local + got <= max(local, num_tokens - 1)


def test_what_each_kind_needs():
    n = 128
    assert list(Group(0, GroupKind.FULL, 32).needed(n)) == [0, 1, 2, 3]
    assert list(Group(0, GroupKind.FULL, 32).needed(n, local=64)) == [2, 3]
    assert list(Group(0, GroupKind.SLIDING, 32, window=64).needed(n)) == [2, 3]      # tokens 65..127
    assert list(Group(0, GroupKind.SLIDING, 32, window=64, extra=40).needed(n)) == [0, 1, 2, 3]
    assert list(Group(0, GroupKind.CHUNKED, 32, chunk=64).needed(n)) == []           # a new chunk starts at 128
    assert list(Group(0, GroupKind.CHUNKED, 32, chunk=64).needed(96)) == [2]
    assert list(Group(0, GroupKind.MAMBA, 32).needed(n)) == [3]                      # the state at 128
    assert key_index(Group(0, GroupKind.FULL, 64), 1, 32) == 3


def test_a_window_past_a_gap_still_hits():
    """Sliding window 32 over 16-token blocks: blocks 0-1 gone, 2-5 present: a hit of 96 needs
    only blocks 4-5 (the window), so it is served though the prefix is not."""
    g = Group(1, GroupKind.SLIDING, 16, window=32)
    present = lambda g, i: i >= 2  # noqa: E731
    assert hit_tokens([g], present, 0, num_tokens=97, num_hashes=6, hash_tokens=16) == 96
    full = Group(0, GroupKind.FULL, 16)
    assert hit_tokens([full, g], present, 0, num_tokens=97, num_hashes=6, hash_tokens=16) == 0
