"""End to end inside real vLLM (CPU build): tokens with kvtier loads == tokens without.

One process (VLLM_ENABLE_V1_MULTIPROCESSING=0, uni executor), a tiny random Llama saved at test
time, prefix caching off so the second pass of the same prompts is served by kvtier.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import vllm_util as U  # noqa: E402

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not U.vllm_available(), reason="vLLM not installed")]

N_PROMPTS = 4
BLOCKS = 4
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def prompts():
    return U.prompts(N_PROMPTS, BLOCKS, seed=7)


@pytest.fixture(scope="module")
def baseline(model_dir, prompts):
    llm = U.make_llm(model_dir)
    out = U.generate(llm, prompts, MAX_TOKENS)
    U.shutdown(llm)
    return out


def _parts():
    import kvtier.connector as C
    s = [c for c in C.live_connectors("scheduler") if c.sched is not None]
    w = [c for c in C.live_connectors("worker") if c.worker is not None and c.worker.layout is not None]
    assert len(s) == 1 and len(w) == 1, (len(s), len(w))
    return s[0], w[0]


def _full_blocks(p):  # blocks a request may load: at least one token is left to compute
    return (len(p) - 1) // U.BLOCK


def test_second_pass_served_by_kvtier(model_dir, prompts, baseline):
    # the shipped YAML stack through kvtier.core.config, with an inline override of its capacity
    llm = U.make_llm(model_dir, U.kvtier_config(config="cpu-only", cpu_capacity_blocks=64))
    try:
        s, w = _parts()
        first = U.generate(llm, prompts, MAX_TOKENS)
        t1 = dict(s.sched.totals)
        assert t1.get("hit_tokens", 0) == 0
        # every full block computed in pass 1 was stored (prompt + generated tokens)
        stored = sum((len(p) + MAX_TOKENS - 1) // U.BLOCK for p in prompts)
        assert t1["stored_blocks.cpu"] == stored
        assert w.worker.totals["blocks_stored.cpu"] == stored

        second = U.generate(llm, prompts, MAX_TOKENS)
        t2 = s.sched.totals
        want = sum(_full_blocks(p) for p in prompts)
        assert t2["hit_blocks.cpu"] == want
        assert t2["hit_tokens"] == want * U.BLOCK
        assert w.worker.totals["blocks_loaded.cpu"] == want
        assert w.worker.totals["bytes_loaded.cpu"] == want * w.worker.layout.block_bytes
        assert first == baseline
        assert second == baseline
        assert s.sched.leases.pinned() == 0 and s.sched.pinned_blocks() == 0

        # the check is not vacuous: noise in the stored blocks changes the tokens
        assert w.worker.pools[0].num_slots == 64
        for p in w.worker.pools:
            p.buffer.copy_(_noise(p.buffer))
        noisy = U.generate(llm, prompts, MAX_TOKENS)
        assert noisy != baseline
    finally:
        U.shutdown(llm)


def _noise(buf):
    import torch
    g = torch.Generator().manual_seed(0)
    return (torch.randn(buf.numel() // 4, generator=g) * 3).view(torch.uint8)


def test_load_failure_recomputes(model_dir, prompts, baseline, monkeypatch):
    from kvtier.tiers import io_engine as io_hooks

    llm = U.make_llm(model_dir, U.kvtier_config(cpu_capacity_blocks=64))
    try:
        s, w = _parts()
        assert U.generate(llm, prompts, MAX_TOKENS) == baseline
        monkeypatch.setattr(io_hooks.HOOKS, "counts", {})
        monkeypatch.setattr(io_hooks.HOOKS, "fault", ("load_copy", "error", 1))   # every load fails
        out = U.generate(llm, prompts, MAX_TOKENS)
        assert out == baseline                       # vLLM recomputed the blocks we failed to load
        assert s.sched.totals.get("load_failed_requests", 0) == len(prompts)
        assert s.sched.leases.pinned() == 0 and s.sched.pinned_blocks() == 0
    finally:
        U.shutdown(llm)


@pytest.mark.parametrize("kvtier_first", [False, True], ids=["example-first", "kvtier-first"])
def test_multiconnector_sibling(model_dir, prompts, baseline, tmp_path, kvtier_first):
    """With vLLM's ExampleConnector as sibling. The first child with a hit is chosen; the
    other gets update_state_after_alloc(..., 0) and kvtier must let its leases go."""
    cfg = U.multi_config(str(tmp_path / "example"), kvtier_first=kvtier_first, cpu_capacity_blocks=64)
    llm = U.make_llm(model_dir, cfg)
    try:
        s, w = _parts()
        first = U.generate(llm, prompts, MAX_TOKENS)
        second = U.generate(llm, prompts, MAX_TOKENS)
        assert first == baseline and second == baseline
        t = s.sched.totals
        if kvtier_first:
            want = sum(_full_blocks(p) for p in prompts)
            assert t["hit_tokens"] == want * U.BLOCK
            assert w.worker.totals["blocks_loaded.cpu"] == want
        else:
            # ExampleConnector stored the prompts in pass 1 and is asked first, so it is chosen:
            # kvtier had hits (leases taken) but was passed 0 and released them.
            assert t.get("hit_tokens", 0) == 0
            assert t["n_leases_not_chosen"] == len(prompts)
        assert s.sched.leases.pinned() == 0 and s.sched.pinned_blocks() == 0
    finally:
        U.shutdown(llm)


# ---- NVMe tier: restart and corruption ------------------------------------------------------
NVME_BLOCKS = 64


def _report(capsys, title, passes):
    with capsys.disabled():
        print(f"\n[kvtier e2e] {title}: external hit tokens per tier per pass")
        for name, hits in passes:
            print(f"  {name:<28} cpu={hits['cpu']:>5}  nvme={hits['nvme']:>5}")


@pytest.fixture(scope="module")
def copied(model_dir, prompts, baseline, tmp_path_factory):
    """Pass 1 with a CPU + NVMe stack (write-through); the NVMe directory it leaves behind."""
    d = tmp_path_factory.mktemp("nvme") / "tier"
    llm = U.make_llm(model_dir, U.kvtier_config(cpu_capacity_blocks=64, nvme_path=str(d),
                                                nvme_capacity_blocks=NVME_BLOCKS))
    try:
        s, w = _parts()
        out = U.generate(llm, prompts, MAX_TOKENS)
        # write-behind (default nvme_write_lag_steps=4): every write is reported within 4 steps
        U.run_steps(llm, 5)
        stored = sum((len(p) + MAX_TOKENS - 1) // U.BLOCK for p in prompts)
        t = dict(s.sched.totals)
        assert out == baseline
        assert t["stored_blocks.cpu"] == stored and t["stored_blocks.nvme"] == stored
        assert w.worker.totals["blocks_stored.nvme"] == stored
        assert s.sched.pinned_blocks() == 0 and s.sched.ctrl.in_flight == 0
        hits = U.tier_hits({}, t)
    finally:
        U.shutdown(llm)
    return d, hits


def _copy_tier(src, dst):
    import shutil
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("promote", [True, False])
def test_nvme_restart_restores(model_dir, prompts, baseline, copied, tmp_path, capsys, promote):
    """A new LLM (new connector objects, empty CPU tier) on the same NVMe path: every full block of
    the repeat pass is an external hit from NVMe; a third pass hits the CPU (promoted on read) or,
    with promotion off, NVMe again (every prompt's blocks read through the step's staging rows)."""
    src, pass1 = copied
    d = _copy_tier(src, tmp_path / "tier")
    llm = U.make_llm(model_dir, U.kvtier_config(cpu_capacity_blocks=64, nvme_path=str(d), promote=promote,
                                                nvme_capacity_blocks=NVME_BLOCKS))
    try:
        s, w = _parts()
        nv = s.sched.tiers[1]
        stored = sum((len(p) + MAX_TOKENS - 1) // U.BLOCK for p in prompts)
        assert nv.restored_blocks == stored and s.sched.tiers[0].num_resident == 0
        want = sum(_full_blocks(p) for p in prompts)
        t0 = dict(s.sched.totals)
        second = U.generate(llm, prompts, MAX_TOKENS)
        t1 = dict(s.sched.totals)
        third = U.generate(llm, prompts, MAX_TOKENS)
        t2 = dict(s.sched.totals)
        p2, p3 = U.tier_hits(t0, t1), U.tier_hits(t1, t2)
        _report(capsys, f"restart (promotion {'on' if promote else 'off'})",
                [("pass 1 (LLM #1, cold)", pass1), ("pass 2 (LLM #2, restart)", p2), ("pass 3 (LLM #2)", p3)])
        assert second == baseline and third == baseline
        assert p2 == {"cpu": 0, "nvme": want * U.BLOCK}
        assert w.worker.corrupt_blocks == 0
        if promote:
            assert w.worker.totals["blocks_loaded.nvme"] == want
            assert p3 == {"cpu": want * U.BLOCK, "nvme": 0}    # promoted into the CPU tier on read
        else:
            assert w.worker.totals["blocks_loaded.nvme"] == 2 * want
            assert p3 == {"cpu": 0, "nvme": want * U.BLOCK}    # not promoted: NVMe again
        assert s.sched.leases.pinned() == 0 and s.sched.pinned_blocks() == 0
    finally:
        U.shutdown(llm)


def test_nvme_hits_load_asynchronously(model_dir, prompts, baseline, copied, tmp_path, monkeypatch):
    """With hits below DRAM loading asynchronously (on by default for a device; forced here on the
    CPU build), a restart's NVMe hits go through vLLM's WAITING_FOR_REMOTE_KVS: every prompt's hit
    is an asynchronous load, its reads and copies run after a step's forward (`get_finished`), it is
    reported received, and the tokens equal vLLM's own."""
    from kvtier.connector import sides
    monkeypatch.setattr(sides, "lower_loads_async", lambda cfg: True)
    src, _ = copied
    d = _copy_tier(src, tmp_path / "tier")
    llm = U.make_llm(model_dir, U.kvtier_config(cpu_capacity_blocks=64, nvme_path=str(d),
                                                nvme_capacity_blocks=NVME_BLOCKS))
    try:
        s, w = _parts()
        asked = []
        real = s.sched.loads_async
        monkeypatch.setattr(s.sched, "loads_async", lambda rid: asked.append(real(rid)) or asked[-1])
        want = sum(_full_blocks(p) for p in prompts)
        t0 = dict(s.sched.totals)
        second = U.generate(llm, prompts, MAX_TOKENS)
        assert second == baseline
        assert U.tier_hits(t0, dict(s.sched.totals)) == {"cpu": 0, "nvme": want * U.BLOCK}
        assert asked == [True] * len(prompts)
        assert w.worker.totals["blocks_loaded.nvme"] == want and w.worker.loads_in_flight == 0
        assert s.sched.leases.pinned() == 0 and s.sched.pinned_blocks() == 0
    finally:
        U.shutdown(llm)


def test_weights_identify_the_model(model_dir, prompts, baseline, copied, tmp_path, capsys):
    """The fingerprint names the weights, not the path: the same weights copied to another path are
    served from the NVMe tier written by the first; other weights written in place under that path
    are a new fingerprint (its blocks namespaced away, none served) and the tokens are the new
    model's own."""
    import shutil

    src, _ = copied
    d = _copy_tier(src, tmp_path / "tier")
    m = tmp_path / "served-model"
    shutil.copytree(model_dir, m)
    want = sum(_full_blocks(p) for p in prompts)
    kv = U.kvtier_config(cpu_capacity_blocks=64, nvme_path=str(d), nvme_capacity_blocks=NVME_BLOCKS,
                         nvme_on_mismatch="namespace")
    llm = U.make_llm(str(m), kv)
    try:
        s, _w = _parts()
        t0 = dict(s.sched.totals)
        same = U.generate(llm, prompts, MAX_TOKENS)
        moved = U.tier_hits(t0, dict(s.sched.totals))
    finally:
        U.shutdown(llm)
    other = U.build_tiny_llama(tmp_path / "other", seed=1)
    for f in ("model.safetensors", "config.json"):
        shutil.copyfile(os.path.join(other, f), m / f)      # a new checkpoint, in place
    llm = U.make_llm(str(m), kv)
    try:
        s, w = _parts()
        assert s.sched.tiers[1].restored_blocks == 0
        t0 = dict(s.sched.totals)
        first = U.generate(llm, prompts, MAX_TOKENS)
        t1 = dict(s.sched.totals)
        again = U.generate(llm, prompts, MAX_TOKENS)
        swapped, p2 = U.tier_hits(t0, t1), U.tier_hits(t1, dict(s.sched.totals))
    finally:
        U.shutdown(llm)
    _report(capsys, "model identity", [("same weights, new path", moved), ("new weights, same path", swapped),
                                       ("new weights, pass 2", p2)])
    assert same == baseline and moved == {"cpu": 0, "nvme": want * U.BLOCK}
    assert swapped == {"cpu": 0, "nvme": 0}
    assert first == again and first != baseline         # the new model's tokens, computed
    assert p2["cpu"] + p2["nvme"] == want * U.BLOCK     # and then served from what it stored


def test_fsck_checks_the_connectors_directory_without_its_config(copied, tmp_path):
    """`kvtier fsck --dir` checks (and rebuilds) a directory the connector wrote: the fingerprint
    it recorded (vLLM's model digest, KV dtype, parallelism) is one no YAML reproduces."""
    import json
    import subprocess

    src, _ = copied
    d = _copy_tier(src, tmp_path / "tier")
    rec = json.loads((d / "fingerprint.json").read_text())
    assert rec["model"].startswith("weights:") and rec["parts"] == U.PARTS and "tp" not in rec
    assert rec["layout"] == "vllm-kv-blocks/cpu-packed-v1"   # the CPU backend's packed slabs, named (issue 29)
    for extra in ([], ["--rebuild"]):
        r = subprocess.run([sys.executable, "-m", "kvtier", "fsck", "--dir", str(d), "--json", *extra],
                           capture_output=True, text=True, timeout=120)
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert r.returncode == 0 and out["fingerprint"] == "the directory's record", r.stderr
        assert out["blocks_verified"] > 0 and not out["problems"] and out["damaged"] is None
        if extra:
            assert out["rebuilt_entries"] == out["blocks_verified"]


def test_nvme_corruption_recomputes(model_dir, prompts, baseline, copied, tmp_path, capsys):
    """Flip bytes of some blocks in the NVMe data file between the passes: they fail their checksum,
    are reported through get_block_ids_with_load_errors, vLLM recomputes them; tokens identical."""
    from kvtier.tiers.nvme_block import HEADER_BYTES, slot_stride
    from kvtier.tiers.nvme_index import NvmeIndex

    src, pass1 = copied
    d = _copy_tier(src, tmp_path / "tier")
    idx = NvmeIndex(str(d / "index"), NVME_BLOCKS)
    entries = sorted(idx.items(), key=lambda kv: kv[1].slot)
    idx.close()
    bad = [entries[i] for i in (0, 5, len(entries) - 1)]
    stride = slot_stride(entries[0][1].length)
    with open(d / "data.0", "r+b") as f:
        for _, e in bad:  # in the payload, after the slot's header page
            f.seek(e.slot * stride + HEADER_BYTES + 100)
            b = f.read(8)
            f.seek(e.slot * stride + HEADER_BYTES + 100)
            f.write(bytes(x ^ 0xFF for x in b))
            f.flush()
            os.fsync(f.fileno())
    llm = U.make_llm(model_dir, U.kvtier_config(cpu_capacity_blocks=64, nvme_path=str(d),
                                                nvme_capacity_blocks=NVME_BLOCKS))
    try:
        s, w = _parts()
        want = sum(_full_blocks(p) for p in prompts)
        t0 = dict(s.sched.totals)
        second = U.generate(llm, prompts, MAX_TOKENS)
        t1 = dict(s.sched.totals)
        p2 = U.tier_hits(t0, t1)
        wt = w.worker.totals
        _report(capsys, "corruption (3 blocks flipped)",
                [("pass 1 (LLM #1, cold)", pass1), ("pass 2 (LLM #2, planned)", p2),
                 ("pass 2 loaded ok", {"cpu": 0, "nvme": int(wt.get("blocks_loaded.nvme", 0)) * U.BLOCK})])
        with capsys.disabled():
            print(f"  corrupt blocks: worker={w.worker.corrupt_blocks} "
                  f"scheduler={int(t1.get('corrupt_blocks.nvme', 0))} "
                  f"load-failed blocks={int(wt.get('blocks_load_failed.nvme', 0))}")
        assert second == baseline                            # recomputed, never wrong KV
        assert w.worker.corrupt_blocks == len(bad)           # exact
        assert t1["corrupt_blocks.nvme"] == len(bad)
        assert wt["blocks_loaded.nvme"] == want - len(bad)
        assert wt["blocks_load_failed.nvme"] == len(bad)
        cpu = s.sched.tiers[0]
        # the bad entries were quarantined; vLLM recomputed those blocks and they were offered to
        # the store again: DRAM holds them (and NVMe again once written through, from good bytes)
        assert all(k in cpu for k, _ in bad)
        assert s.sched.leases.pinned() == 0 and s.sched.pinned_blocks() == 0
    finally:
        U.shutdown(llm)
    # after a restart: each bad entry is indexed again as the recomputed block, written through
    # (a new write), and reads back verified
    import torch

    from kvtier.cli.common import stored_layout
    from kvtier.policies.lru import LRU
    from kvtier.tiers.nvme import NvmeTier
    lay = stored_layout(str(d))
    bb = int(lay["fingerprint"]["block_bytes"])
    nv = NvmeTier("nvme", str(d), NVME_BLOCKS, bb, LRU(NVME_BLOCKS), io="posix", fingerprint=lay["fingerprint"],
                  read_only=True)
    try:
        again = [nv.find(k) for k, _ in bad]
        assert None not in again
        r = nv.read(again, [torch.empty(bb, dtype=torch.uint8) for _ in again]).wait()
        assert r.ok == [True] * len(again), r.errors
    finally:
        nv.close()


def test_lazy_offload_hits(model_dir, prompts, baseline, capsys):
    """offload: lazy with prefix caching on and a GPU pool too small to keep every prompt: blocks are
    copied down from the GPU free queue before vLLM reuses them, and the repeat pass hits kvtier."""
    llm = U.make_llm(model_dir, U.kvtier_config(cpu_capacity_blocks=64, offload="lazy", max_blocks_per_step=4),
                     enable_prefix_caching=True, num_gpu_blocks_override=12, max_num_seqs=1, max_model_len=256)
    try:
        s, w = _parts()
        assert s.sched.offload == "lazy"
        first = [U.generate(llm, [p], MAX_TOKENS)[0] for p in prompts]   # one request at a time
        t1 = dict(s.sched.totals)
        second = [U.generate(llm, [p], MAX_TOKENS)[0] for p in prompts]
        t2 = dict(s.sched.totals)
        p2 = U.tier_hits(t1, t2)
        _report(capsys, "lazy offload (12 GPU blocks, prefix caching on)",
                [("pass 1", U.tier_hits({}, t1)), ("pass 2", p2)])
        assert first == baseline and second == baseline
        assert t1.get("lazy_offload_blocks", 0) > 0
        assert t1.get("stored_blocks.cpu", 0) == t1["lazy_offload_blocks"]
        assert p2["cpu"] >= 2 * _full_blocks(prompts[0]) * U.BLOCK   # the prompts vLLM had to evict
        assert w.worker.totals["blocks_loaded.cpu"] * U.BLOCK == p2["cpu"]
        assert s.sched.leases.pinned() == 0 and s.sched.pinned_blocks() == 0
        assert not s.sched.lazy.pinned
    finally:
        U.shutdown(llm)


def test_yaml_stack_write_back_exclusive_then_inspect(model_dir, prompts, baseline, tmp_path, capsys):
    """The connector built from a YAML stack (kv_connector_extra_config.config): write-back
    demotion and exclusive promotion act inside vLLM as in replay, and `kvtier inspect --config`
    with the same YAML reads the directory the connector wrote (one schema, one fingerprint)."""
    import json
    import subprocess
    y = tmp_path / "stack.yaml"
    y.write_text(f"""
tiers:
  - {{name: cpu, kind: cpu, capacity_blocks: 12}}
  - {{name: nvme, kind: nvme, path: {tmp_path / 'nv'}, capacity_blocks: {NVME_BLOCKS}, io: posix}}
policy: {{eviction: lru, promotion: exclusive, demotion: write_back}}
serving: {{nvme_write_lag_steps: 0}}
""")
    llm = U.make_llm(model_dir, U.kvtier_config(config=str(y)))
    try:
        s, w = _parts()
        first = [U.generate(llm, [p], MAX_TOKENS)[0] for p in prompts]   # one request at a time
        t1 = dict(s.sched.totals)
        second = [U.generate(llm, [p], MAX_TOKENS)[0] for p in prompts]
        t2 = dict(s.sched.totals)
        p2 = U.tier_hits(t1, t2)
        _report(capsys, "YAML stack: cpu 12 blocks, write-back, exclusive promotion", [("pass 2", p2)])
        with capsys.disabled():
            print("  totals:", {k: int(v) for k, v in sorted(t2.items()) if k.split(".")[0] in (
                "stored_blocks", "demoted_blocks", "promoted_blocks", "evicted_blocks", "store_dropped_blocks")})
        assert first == baseline and second == baseline
        cpu_in, nvme_in = t1["stored_blocks.cpu"], t1.get("demoted_blocks.nvme", 0)
        assert 0 < nvme_in < cpu_in                  # write-back: only what left DRAM (and its window)
        promoted = t2.get("promoted_blocks.cpu", 0) - t1.get("promoted_blocks.cpu", 0)
        left_nvme = t2.get("evicted_blocks.nvme", 0) - t1.get("evicted_blocks.nvme", 0)
        assert p2["nvme"] > 0 and promoted > 0 and left_nvme == promoted   # exclusive: moved up
        held = s.sched.tiers[1].num_resident
        assert held > 0
    finally:
        U.shutdown(llm)
    r = subprocess.run([sys.executable, "-m", "kvtier", "inspect", "--config", str(y), "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    nv = json.loads(r.stdout.strip().splitlines()[-1])["tiers"][1]
    assert nv["resident_blocks"] == held and "model" in nv["config_differs_in"]
    assert nv["fingerprint_is"].startswith("written by the vLLM connector")
    assert nv["block_bytes"] == s.parts.part_bytes   # the tier's own (one part), not the YAML's default
    sv = nv["serving"]   # the scheduler's totals, left in the directory at shutdown
    hits = {k.split(".")[1]: int(v) for k, v in t2.items() if k.startswith("hit_blocks.")}
    assert sv["blocks_looked_up"] == sum(hits.values()) + int(t2.get("miss_blocks", 0))
    assert {k: round(v * sv["blocks_looked_up"]) for k, v in sv["hit_ratio_by_tier"].items()} == hits
