"""A full or read-only disk never stops vLLM: inside real vLLM (CPU build), with the NVMe tier on a
small loop-mounted ext4 file system, every request completes with the tokens of a run without
kvtier, and each failure is counted.

Before: the first load planned after the data file failed to open raised ENOSPC out of
`start_load_kv` (EngineDeadError, the server exited).
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import fs_util  # noqa: E402
import vllm_util as U  # noqa: E402

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not U.vllm_available(), reason="vLLM not installed")]

N_PROMPTS = 24
BLOCKS = 9       # 300 tokens: 9 full blocks of 32, and 12 more
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def prompts():
    return U.prompts(N_PROMPTS, BLOCKS, seed=11, extra=12)


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


def _passes(llm, prompts, baseline):
    """Every prompt, then all again in reverse (the newest in DRAM, the rest planned from NVMe)."""
    assert U.generate(llm, prompts, MAX_TOKENS) == baseline
    rev = U.generate(llm, prompts[::-1], MAX_TOKENS)
    assert rev == baseline[::-1]


def test_tier_on_a_small_disk_serves(model_dir, prompts, baseline):
    """12 MiB of NVMe on a 24 MiB file system: the requests are served, some from NVMe (a tier
    larger than the disk is refused at start: tests/test_e2e_fit.py)."""
    with fs_util.small_fs("24M") as fs:
        mnt = fs.path
        llm = U.make_llm(model_dir, U.kvtier_config(cpu_capacity_blocks=128, nvme_path=os.path.join(mnt, "kv"),
                                                    nvme_capacity="12MiB"))
        try:
            s, w = _parts()
            nv = s.sched.tiers[1]
            assert nv.capacity_blocks == (12 << 20) // (32 << 10)           # the size asked, in force
            _passes(llm, prompts, baseline)
            t = s.sched.totals
            assert t.get("hit_blocks.nvme", 0) > 0                          # and it serves
            assert not any(k.startswith("hook_errors") for k in t)
            assert not any(k.startswith("hook_errors") for k in w.worker.totals)
            assert w.worker.totals.get("nvme_open_failed", 0) == 0
        finally:
            U.shutdown(llm)


def test_disk_full_then_read_only_mid_run(model_dir, prompts, baseline):
    """The tier fits at start and holds blocks; then the file system fills up, and loads from NVMe
    are planned on the full disk; then it turns read-only (data and index writes fail with EROFS):
    every request completes with the baseline's tokens, the failures are counted, none raised."""
    with fs_util.small_fs("24M") as fs:
        mnt = fs.path
        # DRAM below the NVMe tier's 128 blocks: the reversed pass is planned from NVMe
        llm = U.make_llm(model_dir, U.kvtier_config(cpu_capacity_blocks=48, nvme_path=os.path.join(mnt, "kv"),
                                                    nvme_capacity="4MiB", nvme_write_lag_steps=0))
        try:
            s, w = _parts()
            assert U.generate(llm, prompts, MAX_TOKENS) == baseline
            t0 = dict(s.sched.totals)
            assert t0.get("stored_blocks.nvme", 0) > 0
            fs.fill()
            _passes(llm, prompts, baseline)
            t1 = dict(s.sched.totals)
            assert t1.get("hit_blocks.nvme", 0) > t0.get("hit_blocks.nvme", 0)   # loads ran on the full disk
            fs.make_read_only()
            _passes(llm, prompts, baseline)
            t2 = dict(s.sched.totals)
            failed = lambda t: t.get("store_failed_blocks.nvme", 0) + t.get("index_write_errors.nvme", 0)  # noqa: E731
            assert failed(t2) > failed(t1)                                     # EROFS, counted
            assert t2.get("hit_blocks.nvme", 0) > t1.get("hit_blocks.nvme", 0)  # and still read
            for part in (s.sched.totals, w.worker.totals):
                assert not any(k.startswith("hook_errors") for k in part), part
        finally:
            U.shutdown(llm)
