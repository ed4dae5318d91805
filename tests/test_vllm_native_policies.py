"""kvtier's eviction policies as vLLM CachePolicy classes (kvtier.vllm.cache_policies), run inside
vLLM's real CPU primary tier manager (`CPUOffloadingManager`, loaded by cache_policy_module_path)
against vLLM's own policies on the same request sequences."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm.v1.kv_offload.cpu.policies.base")

from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # noqa: E402

VLLM = {"lru": ("lru", None), "arc": ("arc", None)}
KVTIER = {"lru": ("KvtierLRU", "kvtier.vllm"), "arc": ("KvtierARC", "kvtier.vllm"),
          "s3fifo": ("KvtierS3FIFO", "kvtier.vllm")}


def key(conv: int, pos: int) -> bytes:
    return make_offload_key(conv.to_bytes(4, "little") + pos.to_bytes(4, "little") + b"\0" * 24, 0)


class Primary:
    """vLLM's CPU primary tier with one policy, driven the way the offloading scheduler drives it."""

    def __init__(self, policy: tuple[str, str | None], cap: int) -> None:
        self.m = CPUOffloadingManager(num_chunks=cap, cache_policy=policy[0], cache_policy_module_path=policy[1])
        self.n = 0
        self.pending: list[tuple[list[bytes], ReqContext]] = []

    def _ctx(self) -> ReqContext:
        self.n += 1
        ctx = ReqContext(req_id=f"r{self.n}")
        self.m.on_new_request(ctx)
        return ctx

    def request(self, keys: list[bytes], defer: bool = False):
        """Load the cached prefix, store the rest (the store completes now or at the next call)."""
        self.flush()
        ctx = self._ctx()
        hit = 0
        for k in keys:
            if self.m.lookup(k, ctx) is not LookupResult.HIT:
                break
            hit += 1
        if hit:
            self.m.prepare_load(keys[:hit], ctx)
            self.m.complete_load(keys[:hit], ctx)
        out = self.m.prepare_store(keys[hit:], ctx) if hit < len(keys) else None
        evicted = list(out.evicted_keys) if out is not None else None
        self.pending.append((list(out.keys_to_store) if out is not None else [], ctx))
        if not defer:
            self.flush()
        return hit, evicted

    def flush(self) -> None:
        for keys, ctx in self.pending:
            if keys:
                self.m.complete_store(keys, ctx)
            self.m.on_request_finished(ctx)
        self.pending = []

    def resident(self, keys) -> set[bytes]:
        ctx = self._ctx()
        out = {k for k in keys if self.m.lookup(k, ctx) is LookupResult.HIT}
        self.m.on_request_finished(ctx)
        return out


def workload(seed: int, n: int = 400):
    """Multi-turn conversations: each request extends or repeats a prefix of one conversation."""
    rng = random.Random(seed)
    lengths: dict[int, int] = {}
    for _ in range(n):
        conv = rng.randrange(12)
        grow = rng.random() < 0.6
        length = min(20, lengths.get(conv, 0) + (rng.randint(1, 4) if grow else 0)) or 1
        lengths[conv] = max(lengths.get(conv, 0), length)
        use = length if grow else rng.randint(1, length)
        yield [key(conv, p) for p in range(use)], rng.random() < 0.3


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_kvtier_lru_evicts_exactly_as_vllm_lru(seed):
    ours, theirs = Primary(KVTIER["lru"], 24), Primary(VLLM["lru"], 24)
    evictions = 0
    for keys, defer in workload(seed):
        a, b = ours.request(keys, defer), theirs.request(keys, defer)
        assert a == b                                        # same hits, same victims in the same order
        evictions += len(a[1] or [])
    assert evictions > 100                                   # the sequence did exercise eviction


def test_kvtier_arc_keeps_reused_chunks_through_a_scan_as_vllm_arc_does():
    """vLLM's ARC expectation: chunks a request reused (T2) outlive chunks seen once (T1) under a
    scan; vLLM's LRU, the contrast, loses them."""
    results = {}
    for name, pol in (("vllm-arc", VLLM["arc"]), ("kvtier-arc", KVTIER["arc"]), ("kvtier-s3fifo", KVTIER["s3fifo"]),
                      ("vllm-lru", VLLM["lru"])):
        p = Primary(pol, 8)
        hot = [key(0, i) for i in range(4)]
        p.request(hot + [key(1, i) for i in range(4)])
        assert p.request(hot)[0] == 4                        # reused: a second access
        for s in range(3):                                   # a scan of single-use chunks, 1.5x the cache
            p.request([key(100 + s, i) for i in range(4)])
        results[name] = p.resident(hot)
    assert results["vllm-arc"] == set(hot)
    assert results["kvtier-arc"] == results["vllm-arc"]
    # S3-FIFO (no vLLM counterpart): a hit only bumps a frequency; its tiny probationary queue
    # (10% of 8 chunks) lets the scan take one hot chunk here, still far more kept than LRU's none
    assert len(results["kvtier-s3fifo"]) >= 3
    assert results["vllm-lru"] == set()


@pytest.mark.parametrize("policy", ["arc", "s3fifo"])
def test_kvtier_policies_run_vllm_sequences_within_capacity(policy):
    """Over the same sequences: never more resident than the cache, no pinned chunk evicted (the
    deferred stores), and hit counts of the same order as vLLM's LRU."""
    ours, lru = Primary(KVTIER[policy], 24), Primary(VLLM["lru"], 24)
    hits = [0, 0]
    for keys, defer in workload(7):
        a, b = ours.request(keys, defer), lru.request(keys, defer)
        hits[0] += a[0]
        hits[1] += b[0]
        assert len(ours.m._policy.chunks) <= 24
    assert hits[0] > 0.5 * hits[1]
