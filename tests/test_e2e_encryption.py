"""Encryption at rest inside real vLLM (CPU build): an encrypted NVMe tier written by one LLM is
served to the next with the right key, and with a wrong key every block is a load error that vLLM
recomputes: tokens identical to no kvtier either way (issue 26)."""

from __future__ import annotations

import os
import shutil
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import vllm_util as U  # noqa: E402

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not U.vllm_available(), reason="vLLM not installed")]

N_PROMPTS = 4
BLOCKS = 4
MAX_TOKENS = 8
NVME_BLOCKS = 64


@pytest.fixture(scope="module")
def prompts():
    return U.prompts(N_PROMPTS, BLOCKS, seed=11)


@pytest.fixture(scope="module")
def baseline(model_dir, prompts):
    llm = U.make_llm(model_dir)
    out = U.generate(llm, prompts, MAX_TOKENS)
    U.shutdown(llm)
    return out


def _stack(tmp, nvme_dir, key: bytes) -> str:
    kf = tmp / f"key-{key[:2].hex()}"
    if not kf.exists():
        kf.write_bytes(key.hex().encode())
        os.chmod(kf, 0o600)
    y = tmp / f"stack-{key[:2].hex()}-{os.path.basename(nvme_dir)}.yaml"
    y.write_text(f"""
tiers:
  - {{name: cpu, kind: cpu, capacity_blocks: 64}}
  - {{name: nvme, kind: nvme, path: {nvme_dir}, capacity_blocks: {NVME_BLOCKS}, io: posix,
      encryption: {{key_file: {kf}}}}}
""")
    return str(y)


def _parts():
    import kvtier.connector as C
    s = [c for c in C.live_connectors("scheduler") if c.sched is not None]
    w = [c for c in C.live_connectors("worker") if c.worker is not None and c.worker.layout is not None]
    assert len(s) == 1 and len(w) == 1, (len(s), len(w))
    return s[0], w[0]


def test_encrypted_nvme_right_key_hits_wrong_key_recomputes(model_dir, prompts, baseline, tmp_path):
    k1, k2 = os.urandom(32), os.urandom(32)
    d = tmp_path / "tier"
    stored = sum((len(p) + MAX_TOKENS - 1) // U.BLOCK for p in prompts)
    want = sum((len(p) - 1) // U.BLOCK for p in prompts)
    llm = U.make_llm(model_dir, U.kvtier_config(config=_stack(tmp_path, d, k1)))
    try:
        s, w = _parts()
        assert U.generate(llm, prompts, MAX_TOKENS) == baseline
        U.run_steps(llm, 5)  # write-behind: every NVMe write reported
        assert s.sched.totals["stored_blocks.nvme"] == stored
        assert all(p.codec.sealer is not None for p in w.worker.nvme.planes)   # each part's file
    finally:
        U.shutdown(llm)
    right, wrong = shutil.copytree(d, tmp_path / "right"), shutil.copytree(d, tmp_path / "wrong")

    llm = U.make_llm(model_dir, U.kvtier_config(config=_stack(tmp_path, right, k1)))
    try:
        s, w = _parts()
        t0 = dict(s.sched.totals)
        assert U.generate(llm, prompts, MAX_TOKENS) == baseline
        assert U.tier_hits(t0, s.sched.totals) == {"cpu": 0, "nvme": want * U.BLOCK}
        assert w.worker.totals["blocks_loaded.nvme"] == want and w.worker.corrupt_blocks == 0
    finally:
        U.shutdown(llm)

    llm = U.make_llm(model_dir, U.kvtier_config(config=_stack(tmp_path, wrong, k2)))
    try:
        s, w = _parts()
        assert U.generate(llm, prompts, MAX_TOKENS) == baseline      # recomputed: never wrong KV
        wt = w.worker.totals
        assert int(wt.get("blocks_loaded.nvme", 0)) == 0
        assert wt["blocks_load_failed.nvme"] == want and w.worker.corrupt_blocks == want
        assert s.sched.totals["corrupt_blocks.nvme"] == want              # quarantined: later lookups miss
        assert s.sched.leases.pinned() == 0 and s.sched.pinned_blocks() == 0
    finally:
        U.shutdown(llm)
