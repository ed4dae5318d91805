"""Faults on the load and store paths inside real vLLM (CPU build), through the fault points any
checker can set (`KVTIER_FAULT`, tiers/io_engine.py): the N-th and later NVMe reads fail with EIO,
queuings of a load's copies into the KV raise, the forward's layer waits raise, the KV -> DRAM
copies of a store raise. Each time the tokens equal a run without kvtier, and a restart on the same
NVMe directory serves only good blocks (tokens equal, nothing fails verification, fsck clean).

One LLM serves every fault in turn (the points are set in this process: the uni executor runs the
worker here); the restart is a second one."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import vllm_util as U  # noqa: E402

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not U.vllm_available(), reason="vLLM not installed")]

MAX_TOKENS = 8
NVME_BLOCKS = 64


@pytest.fixture(scope="module")
def prompts():
    """Prompts served again under each fault; fresh ones for the store fault (nothing to store
    when every block is already there)."""
    return {"again": U.prompts(4, 4, seed=7), "fresh": U.prompts(3, 3, seed=23)}


@pytest.fixture(scope="module")
def baseline(model_dir, prompts):
    llm = U.make_llm(model_dir)
    try:
        return {k: U.generate(llm, p, MAX_TOKENS) for k, p in prompts.items()}
    finally:
        U.shutdown(llm)


def _config(d):
    # a DRAM tier smaller than the prompts, not promoted into: every pass loads from both tiers
    return U.kvtier_config(cpu_capacity_blocks=8, nvme_path=str(d), nvme_capacity_blocks=NVME_BLOCKS,
                           promote=False)


def _parts():
    import kvtier.connector as C
    s = [c for c in C.live_connectors("scheduler") if c.sched is not None]
    w = [c for c in C.live_connectors("worker") if c.worker is not None and c.worker.layout is not None]
    assert len(s) == 1 and len(w) == 1, (len(s), len(w))
    return s[0].sched, w[0].worker


@pytest.fixture(scope="module")
def served(model_dir, prompts, baseline, tmp_path_factory):
    """The LLM the faults are injected into, after a clean pass that stored the prompts (written
    through to NVMe and reported)."""
    d = tmp_path_factory.mktemp("nvme") / "tier"
    llm = U.make_llm(model_dir, _config(d))
    try:
        for p, want in zip(prompts["again"], baseline["again"]):  # each written through before the next
            assert U.generate(llm, [p], MAX_TOKENS) == [want]        # evicts it from the small DRAM tier
            U.run_steps(llm, 5)
        s, w = _parts()
        assert s.totals["stored_blocks.nvme"] == s.totals["stored_blocks.cpu"] == 16
        yield llm, d
    finally:
        U.shutdown(llm)


POINTS = [("read", "EIO"), ("load_copy", "error"), ("layer_wait", "error"), ("store_copy", "error")]


@pytest.mark.parametrize("point,kind", POINTS, ids=[p for p, _ in POINTS])
def test_fault_point_gives_the_same_tokens(served, prompts, baseline, monkeypatch, caplog, capsys, point, kind):
    from kvtier.tiers.io_engine import HOOKS

    llm, _ = served
    s, w = _parts()
    which = "fresh" if point == "store_copy" else "again"
    t0, w0 = dict(s.totals), dict(w.totals)
    monkeypatch.setattr(HOOKS, "counts", {})
    monkeypatch.setattr(HOOKS, "fault", (point, kind, 1))
    with caplog.at_level(logging.WARNING, logger="kvtier.faults"):
        out = U.generate(llm, prompts[which], MAX_TOKENS)
        U.run_steps(llm, 5)
    monkeypatch.setattr(HOOKS, "fault", None)
    t1, w1 = dict(s.totals), dict(w.totals)
    d = {k: w1.get(k, 0) - w0.get(k, 0) for k in set(w1) | set(w0)}
    ds = {k: t1.get(k, 0) - t0.get(k, 0) for k in set(t1) | set(t0)}
    injected = [r for r in caplog.records if r.name == "kvtier.faults"]
    with capsys.disabled():
        print(f"\n[kvtier e2e] fault {point}:{kind}:1: {len(injected)} injected, worker "
              + json.dumps({k: v for k, v in sorted(d.items()) if v and k.startswith(("blocks_", "layer_", "load_"))})
              + " scheduler " + json.dumps({k: v for k, v in sorted(ds.items()) if v and "blocks" in k}))
    assert out == baseline[which]                        # vLLM recomputed whatever kvtier failed
    assert HOOKS.counts.get(point, 0) >= 1 and len(injected) == HOOKS.counts[point]
    assert all(f"injected fault at {point}" in r.getMessage() for r in injected)
    hit_blocks = ds.get("hit_blocks.cpu", 0) + ds.get("hit_blocks.nvme", 0)
    if point == "read":          # every NVMe block fails; the DRAM ones load
        assert d.get("blocks_load_failed.nvme", 0) == ds.get("hit_blocks.nvme", 0) > 0
        assert d.get("blocks_loaded.nvme", 0) == 0 and d.get("blocks_loaded.cpu", 0) == ds.get("hit_blocks.cpu", 0)
    elif point == "load_copy":   # every load fails, from either tier
        assert hit_blocks > 0 and d.get("blocks_loaded.cpu", 0) + d.get("blocks_loaded.nvme", 0) == 0
        assert d.get("blocks_load_failed.cpu", 0) + d.get("blocks_load_failed.nvme", 0) == hit_blocks
        assert ds.get("load_failed_requests", 0) == len(prompts[which])
    elif point == "layer_wait":  # the host waits instead (the copies ran): every block loads
        assert d.get("layer_wait_failed", 0) == HOOKS.counts[point] > 0
        assert d.get("blocks_loaded.cpu", 0) + d.get("blocks_loaded.nvme", 0) == hit_blocks > 0
        assert ds.get("load_failed_requests", 0) == 0
    else:                        # every store dropped: nothing of the fresh prompts is kept
        assert hit_blocks == 0 and ds.get("stored_blocks.cpu", 0) == ds.get("stored_blocks.nvme", 0) == 0
        assert d.get("blocks_stored.cpu", 0) == 0
    assert s.leases.pinned() == 0 and s.pinned_blocks() == 0


def test_restart_serves_only_good_blocks(served, model_dir, prompts, baseline, capsys):
    """After every fault: a new LLM on the same directory serves what was stored, all verified;
    the fresh prompts (whose stores failed) are computed, then stored."""
    llm, d = served
    U.shutdown(llm)
    # the index rebuilt from the block headers holds exactly the 16 blocks stored: no write of a
    # failed store's stale DRAM slot reached the disk under a fresh prompt's key
    r = subprocess.run([sys.executable, "-m", "kvtier", "fsck", "--dir", str(d), "--json", "--rebuild"],
                       capture_output=True, text=True, timeout=120)
    fsck = json.loads(r.stdout.strip().splitlines()[-1])
    assert r.returncode == 0 and not fsck["problems"] and fsck["damaged"] is None, r.stderr
    assert fsck["blocks_verified"] == fsck["rebuilt_entries"] == 16
    llm = U.make_llm(model_dir, _config(d))
    try:
        s, w = _parts()
        again = U.generate(llm, prompts["again"], MAX_TOKENS)
        fresh = U.generate(llm, prompts["fresh"], MAX_TOKENS)
        t = s.totals
        with capsys.disabled():
            print(f"\n[kvtier e2e] restart after the faults: hit blocks nvme={t.get('hit_blocks.nvme', 0)} "
                  f"cpu={t.get('hit_blocks.cpu', 0)}, corrupt={w.corrupt_blocks}")
        assert again == baseline["again"] and fresh == baseline["fresh"]
        assert t["hit_blocks.nvme"] == 16 and w.totals["blocks_loaded.nvme"] == 16   # 4 full blocks x 4 prompts
        assert w.corrupt_blocks == 0 and "blocks_load_failed.nvme" not in w.totals
    finally:
        U.shutdown(llm)


def test_spec_decoding_v1_order_drops_what_a_failed_load_computed(model_dir, capsys, monkeypatch):
    from kvtier.tiers import io_engine as io_hooks

    """vLLM's V1 model runner with speculative decoding (here a draft model: the target itself) takes the load errors and
    the worker report before the deferred `wait_for_save`. Pass 2 extends stored prompts by two
    blocks while every load fails: that step computes the two new blocks over KV that was never
    loaded; they must not be stored, or pass 3 (served by kvtier) is given them and its tokens
    differ from vLLM's own."""
    spec = {"method": "draft_model", "model": model_dir, "num_speculative_tokens": 2}
    base4 = U.prompts(3, 4, seed=31)
    longer = [p[:4 * U.BLOCK] + q for p, q in zip(base4, U.prompts(3, 2, seed=37))]   # 6 blocks + 5
    llm = U.make_llm(model_dir, speculative_config=spec)
    try:
        want = U.generate(llm, longer, MAX_TOKENS)
    finally:
        U.shutdown(llm)
    llm = U.make_llm(model_dir, U.kvtier_config(cpu_capacity_blocks=64), speculative_config=spec)
    try:
        s, w = _parts()
        U.generate(llm, base4, MAX_TOKENS)                       # pass 1: 4 blocks a prompt stored
        t1 = dict(s.totals)
        monkeypatch.setattr(io_hooks.HOOKS, "counts", {})
        monkeypatch.setattr(io_hooks.HOOKS, "fault", ("load_copy", "error", 1))   # every load fails
        second = U.generate(llm, longer, MAX_TOKENS)             # pass 2: every load fails
        monkeypatch.setattr(io_hooks.HOOKS, "fault", None)
        t2 = dict(s.totals)
        third = U.generate(llm, longer, MAX_TOKENS)              # pass 3: what kvtier holds
        t3 = dict(s.totals)
        with capsys.disabled():
            print(f"\n[kvtier e2e] draft-model spec decoding (V1 hook order): pass 2 hit blocks "
                  f"{t2['hit_blocks.cpu'] - t1.get('hit_blocks.cpu', 0)}, failed requests "
                  f"{t2.get('load_failed_requests', 0)}; pass 3 hit blocks {t3['hit_blocks.cpu'] - t2['hit_blocks.cpu']}")
        assert t2["hit_blocks.cpu"] - t1.get("hit_blocks.cpu", 0) == 12 and t2["load_failed_requests"] == 3
        assert second == want and third == want
        assert t3["hit_blocks.cpu"] - t2["hit_blocks.cpu"] == 12   # not the 2 blocks pass 2 computed over
                                                                    # the failed load (18 and wrong tokens before)
    finally:
        U.shutdown(llm)
