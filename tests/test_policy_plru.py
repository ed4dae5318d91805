"""plru: doomed partial blocks, vLLM's order in probation, protected hits, ARC-style quota."""

from kvtier.keys import make_key
from kvtier.policies import EVICTION, RequestInfo


def K(i):
    return make_key(i)


def test_partial_last_block_first_then_tail_first():
    pol = EVICTION.get("plru")(8)
    keys = [K(i) for i in range(3)]
    pol.on_insert([0, 1, 2], keys, RequestInfo(keys, 0, 0, 2 * 64 + 5, 64, 0.0))
    assert list(pol.victims()) == [2, 1, 0]           # 2 is partial (doomed); then tail-first
    full = [K(10 + i) for i in range(3)]
    pol.on_insert([3, 4, 5], full, RequestInfo(full, 0, 0, 3 * 64, 64, 1.0))
    assert list(pol.victims()) == [2, 1, 0, 5, 4, 3]


def test_new_blocks_of_a_request_leave_before_its_prefix_and_hits_are_protected():
    pol = EVICTION.get("plru")(8, protect=0.5, adapt=False)
    keys = [K(i) for i in range(5)]
    pol.on_insert([0, 1], keys[:2], RequestInfo(keys[:2], 0, 0, 128, 64, 0.0))
    other = [K(50)]
    pol.on_insert([7], other, RequestInfo(other, 0, 0, 64, 64, 0.5))
    info = RequestInfo(keys, 0, 2, 5 * 64, 64, 1.0)
    pol.on_hit([0, 1], info)                            # the prefix was hit: protected
    pol.on_insert([2, 3, 4], keys[2:], RequestInfo(keys, 2, 2, 5 * 64, 64, 1.0))
    assert list(pol.victims()) == [7, 4, 3, 2, 1, 0]


def test_protected_quota_demotes_oldest_to_probation():
    pol = EVICTION.get("plru")(4, protect=0.25, adapt=False)    # quota 1 block
    keys = [K(i) for i in range(3)]
    pol.on_insert([0, 1, 2], keys, RequestInfo())
    pol.on_hit([0])
    pol.on_hit([1])                                      # 0 drops back to probation's tail
    assert list(pol.victims()) == [2, 0, 1]


def test_without_protection_and_partials_plru_is_vllm_lru():
    """protect=0, no doom, no adaptation: the same victims as vllm_lru on a real trace prefix."""
    from kvtier.sim import simulate
    from kvtier.workloads import generate
    reqs = generate("chat", 1, conversations=200)
    a = simulate(reqs, 60, "plru", eviction_params=dict(protect=0.0, doom_partial=False, adapt=False))
    b = simulate(reqs, 60, "vllm_lru")
    assert (a["hit_blocks"], a["evictions"]) == (b["hit_blocks"], b["evictions"])


def test_ghost_hits_move_the_quota():
    pol = EVICTION.get("plru")(8, protect=0.25)
    q0 = pol.quota
    keys = [K(i) for i in range(4)]
    pol.on_insert([0, 1], keys[:2], RequestInfo())
    pol.on_hit([0])
    pol.on_remove_many([0, 1], keys[:2])                 # 0 was hit: "protected" ghost; 1: probation ghost
    pol.on_insert([2], [keys[0]], RequestInfo())
    assert pol.quota > q0
    q1 = pol.quota
    pol.on_insert([3], [keys[1]], RequestInfo())
    assert pol.quota < q1
    assert sorted(pol.victims()) == [2, 3]
