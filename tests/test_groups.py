"""Hybrid KV-cache groups (connector/groups.py): the hit length every group can serve, checked
against a brute force over every candidate length."""

from __future__ import annotations

import math

from hypothesis import given, settings, strategies as st

from kvtier.connector.groups import Group, GroupKind, hit_tokens, key_index


def servable(groups, present, local, cap, unit):
    """Brute force: the largest n in (local, cap], a multiple of `unit`, at which every group has
    the blocks it needs and every full group its whole prefix from `local`; else `local`."""
    fulls = [g for g in groups if g.kind is GroupKind.FULL]

    def ok(n):
        return all(present(g, i) for g in groups for i in g.needed(n, local)) and \
            all(all(present(g, i) for i in range(local // g.block_tokens, n // g.block_tokens)) for g in fulls)
    return max([n for n in range(local + unit, cap + 1, unit) if ok(n)] + [local])


groups_st = st.lists(st.sampled_from([
    Group(0, GroupKind.FULL, 16), Group(1, GroupKind.SLIDING, 16, window=40), Group(2, GroupKind.SLIDING, 16, window=16),
    Group(3, GroupKind.MAMBA, 16), Group(4, GroupKind.CHUNKED, 16, chunk=32), Group(5, GroupKind.FULL, 32),
    Group(6, GroupKind.SLIDING, 32, window=70, extra=5), Group(7, GroupKind.FULL, 16, eagle=True),
    Group(8, GroupKind.SLIDING, 16, window=40, eagle=True)]), min_size=1, max_size=3, unique_by=lambda g: g.gid)


@settings(max_examples=400, deadline=None)
@given(groups=groups_st, bits=st.lists(st.booleans(), min_size=64, max_size=64), local_blocks=st.integers(0, 3),
       num_tokens=st.integers(1, 400), num_hashes=st.integers(0, 24))
def test_hit_equals_the_brute_force(groups, bits, local_blocks, num_tokens, num_hashes):
    """Full groups stop at their longest present prefix; the other groups are checked at each
    candidate; the answer is the largest length every group can serve. With an EAGLE group: the
    largest servable length one block past the cap, less that block, then the largest servable
    length below it."""
    unit = 1
    for g in groups:
        unit = math.lcm(unit, g.block_tokens)
    local = local_blocks * unit
    present = lambda g, i: bits[(g.gid * 7 + i) % 64]  # noqa: E731
    got = hit_tokens(groups, present, local, num_tokens, num_hashes, 16)
    cap = min(num_tokens - 1, num_hashes * 16) // unit * unit
    if any(g.eagle for g in groups):
        over = min(num_tokens - 1 + unit, num_hashes * 16) // unit * unit
        n = servable(groups, present, local, over, unit) - unit
        want = 0 if n <= local else servable(groups, present, local, min(cap, n), unit) - local
    else:
        want = servable(groups, present, local, cap, unit) - local
    assert got == want
    assert got % unit == 0 and local + got <= max(local, num_tokens - 1)


def test_an_eagle_group_drops_the_last_block():
    """Six present blocks, 97 tokens: 96 without a draft group; with one, the hit found one
    block past the cap (none there: 96) less one block: 80."""
    present = lambda g, i: i < 6  # noqa: E731
    full, draft = Group(0, GroupKind.FULL, 16), Group(1, GroupKind.FULL, 16, eagle=True)
    assert hit_tokens([full], present, 0, 97, 7, 16) == 96
    assert hit_tokens([full, draft], present, 0, 97, 7, 16) == 80
    # a prompt of exactly 7 blocks: the cap is 96 (one token left to compute), block 6 is hashed
    # and present, so dropping it loses nothing
    assert hit_tokens([full, draft], lambda g, i: True, 0, 112, 7, 16) == 96


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
