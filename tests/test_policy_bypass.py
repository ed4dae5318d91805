"""bypass admission: a prefix of each run is admitted, the shadows stay bounded, the cap adapts."""

from hypothesis import given, settings, strategies as st

from kvtier.keys import make_key
from kvtier.policies import ADMISSION, RequestInfo


def K(i):
    return make_key(i)


# a request = (conversation, turn length); conversations grow their chain turn by turn
reqs_st = st.lists(st.tuples(st.integers(0, 5), st.integers(1, 40)), min_size=1, max_size=60)


@settings(max_examples=60, deadline=None)
@given(cap=st.integers(1, 64), seq=reqs_st, shadow=st.sampled_from([4, 16, 1024]))
def test_admits_a_prefix_and_shadows_are_bounded(cap, seq, shadow):
    pol = ADMISSION.get("bypass")(capacity=cap, shadow_blocks=shadow)
    chains: dict[int, list[bytes]] = {}
    nxt = 0
    for t, (conv, n) in enumerate(seq):
        chain = chains.setdefault(conv, [K(1_000_000 + conv)])
        for _ in range(n):
            chain.append(K(nxt))
            nxt += 1
        hit = min(len(chain) - 1, t % 7)
        keys = list(chain)
        run = keys[hit:]
        ok = pol.admit(run, RequestInfo(keys, hit, hit, len(keys) * 64, 64, float(t)))
        assert len(ok) == len(run) and all(isinstance(x, bool) for x in ok)
        k = sum(ok)
        assert ok == [True] * k + [False] * (len(run) - k)          # a prefix of the run
        assert k == len(run) or k == pol.limits[pol.cur]             # all, or the cap
        assert min(len(run), min(pol.limits)) <= k and min(pol.limits) >= 1
        assert 0 <= pol.cur < len(pol.fractions)
        assert all(len(od) <= pol.scap for od in pol.shadows)
        assert pol.scap <= max(1, shadow)
        assert all(s >= 0 for s in pol.score)


def test_without_capacity_everything_is_admitted():
    pol = ADMISSION.get("bypass")()
    keys = [K(i) for i in range(10)]
    assert pol.admit(keys, RequestInfo(keys, 0, 0, 640, 64, 0.0)) == [True] * 10


def test_builder_passes_the_tier_capacity():
    from kvtier.sim import simulate
    from kvtier.workloads import generate
    reqs = generate("chat", 1, conversations=100)
    r = simulate(reqs, 50, "vllm_lru", "bypass")
    assert r["hit_ratio"] >= 0.0


def test_long_requests_in_a_small_cache_pick_a_cap_and_beat_vllm_lru():
    """Agent traffic: requests far longer than the cache flush it; the shadows learn to cap."""
    from kvtier.sim import simulate
    from kvtier.workloads import generate
    reqs = generate("agent", 3, sessions=8, duration_s=900)
    cap = 60
    a = simulate(reqs, cap, "vllm_lru", "bypass")
    b = simulate(reqs, cap, "vllm_lru")
    assert a["hit_blocks"] > b["hit_blocks"]
    assert a["rejected"] > 0


def test_cap_stays_off_where_it_does_not_pay():
    """Short chat requests in a roomy cache: the first candidate (admit all) keeps the lead."""
    from kvtier.sim import simulate
    from kvtier.workloads import generate
    reqs = generate("chat", 1, conversations=300)
    a = simulate(reqs, 400, "vllm_lru", "bypass")
    b = simulate(reqs, 400, "vllm_lru")
    assert a["hit_blocks"] == b["hit_blocks"]
