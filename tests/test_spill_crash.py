"""`kvtier spill` SIGKILLed at chosen points of its progress (KVTIER_CRASH_AT: after the k-th data
write, just before the k-th index commit, during the k-th fdatasync), then reopened: nothing
corrupt is served and every batch the spill reported committed is there. The kill points are
counted events, not times, so a loaded machine gives the same result."""

import os
import signal
import subprocess
import sys

import pytest
import torch

from kvtier.offline.blockgen import block_data, block_key, split_block_key

BB = 65536
BATCH = 8
POINTS = [("data_write", 1), ("data_write", 6), ("data_write", 23), ("index_commit", 1),
          ("index_commit", 3), ("fsync", 1), ("fsync", 4)]


def _cfg(tmp_path):
    cfg = tmp_path / "stack.yaml"
    cfg.write_text(f"""
block_bytes: {BB}
tiers:
  - {{name: cpu, kind: cpu, capacity_blocks: 8}}
  - {{name: nvme, kind: nvme, path: {tmp_path}/nvme, capacity_blocks: 512, io: posix}}
""")
    return str(cfg)


def _check(tmp_path, seed, logged):
    """Reopen as a writer would: every logged block is there and reads back exactly."""
    from kvtier.policies.lru import LRU
    from kvtier.core.stack import TierStack
    from kvtier.tiers.nvme import NvmeTier
    with TierStack.from_config(_cfg(tmp_path), with_data=False) as s:
        fp = s.cfg.fingerprint()
    with NvmeTier("nvme", str(tmp_path / "nvme"), 512, BB, LRU(512), io="posix", fingerprint=fp) as t:
        ours = [k for k in t.keys() if (split_block_key(k) or (None,))[0] == seed]
        for i in range(max(logged, default=-1) + 1):
            assert block_key(seed, i) in t, i
        slots = [t.find(k) for k in ours]
        out = [torch.empty(BB, dtype=torch.uint8) for _ in ours]
        res = t.read(slots, out).wait()
        assert res.all_ok and t.corrupt_blocks == 0, res.errors
        for k, o in zip(ours, out):
            assert torch.equal(o, block_data(seed, split_block_key(k)[1], BB))
        return len(ours)


@pytest.mark.crash
@pytest.mark.parametrize("point,k", POINTS)
def test_spill_killed_at_a_chosen_point(tmp_path, point, k):
    cfg = _cfg(tmp_path)
    seed = 100 + k
    log = tmp_path / "commits.log"
    env = dict(os.environ, KVTIER_CRASH_AT=f"{point}:{k}")
    p = subprocess.run([sys.executable, "-m", "kvtier", "spill", "--config", cfg, "--blocks", "200", "--seed",
                        str(seed), "--batch", str(BATCH), "--commit-log", str(log), "-q"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    logged = [int(x) for x in log.read_text().split()] if log.exists() else []
    present = _check(tmp_path, seed, logged)
    assert present >= max(logged, default=-1) + 1
    # the directory is whole: a full spill after the crash succeeds and verifies
    from kvtier.cli.main import main
    assert main(["spill", "--config", cfg, "--blocks", "64", "--seed", "7", "-q"]) == 0
    assert main(["restore", "--config", cfg, "--verify", "--strict", "-q"]) == 0
