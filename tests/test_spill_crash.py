"""`kvtier spill` SIGKILLed at random points, then restore --verify: nothing corrupt is served,
every batch the spill reported committed is there."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from kvtier.blockgen import block_key
from kvtier.cli import main

BB = 65536
BATCH = 8
TRIALS = int(os.environ.get("KVTIER_CRASH_TRIALS", "12"))


@pytest.mark.crash
def test_spill_sigkill_then_restore(tmp_path, capsys):
    cfg = tmp_path / "stack.yaml"
    cfg.write_text(f"""
block_bytes: {BB}
tiers:
  - {{name: cpu, kind: cpu, capacity_blocks: 8}}
  - {{name: nvme, kind: nvme, path: {tmp_path}/nvme, capacity_blocks: 4096, io: posix}}
""")
    rng = random.Random(1234)
    # how long the writing part of a whole spill runs here, so the kills land inside it
    cal_log = tmp_path / "calibrate.log"
    p = subprocess.Popen([sys.executable, "-m", "kvtier", "spill", "--config", str(cfg), "--blocks", "4000",
                          "--seed", "9999", "--batch", str(BATCH), "--commit-log", str(cal_log), "-q"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not cal_log.exists() and p.poll() is None:
        time.sleep(0.01)
    t0 = time.monotonic()
    assert p.wait(120) == 0
    full_s = time.monotonic() - t0
    committed_total = restored_total = killed = 0
    for trial in range(TRIALS):
        seed = trial + 1
        log = tmp_path / f"commits-{trial}.log"
        p = subprocess.Popen([sys.executable, "-m", "kvtier", "spill", "--config", str(cfg), "--blocks", "4000",
                              "--seed", str(seed), "--batch", str(BATCH), "--commit-log", str(log), "-q"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        # wait until it is writing (the log exists), then kill at a random point
        t0 = time.monotonic()
        while not log.exists() and p.poll() is None and time.monotonic() - t0 < 60:
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.9) * full_s)
        p.send_signal(signal.SIGKILL)
        p.wait()
        assert p.returncode in (0, -signal.SIGKILL), p.stderr.read().decode()[-2000:]
        killed += p.returncode == -signal.SIGKILL
        logged = [int(x) for x in log.read_text().split()] if log.exists() else []

        rc = main(["restore", "--config", str(cfg), "--verify", "--seed", str(seed), "--json"])
        r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert rc == 0, r
        assert r["bad_served"] == 0 and r["corrupt"] == 0, r
        # every block of every batch reported committed is present
        from kvtier.stack import TierStack
        with TierStack.from_config(str(cfg)) as s:
            nv = s.tiers[1]
            last = max(logged, default=-1)
            for i in range(last + 1):  # everything spill reported durable is there
                assert block_key(seed, i) in nv, (trial, i)
            ours = sum(1 for k in nv.keys() if k[:4] == (seed & 0xFFFFFFFF).to_bytes(4, "big"))
        committed_total += last + 1
        restored_total += ours
    print(f"\ncrash trials: {TRIALS} ({killed} killed mid-spill, full spill {full_s:.1f} s); blocks reported durable before the kill: {committed_total}; "
          f"blocks restored and verified: {restored_total}; corrupt served: 0")
    assert committed_total > 0
    assert killed >= TRIALS // 2, f"only {killed} of {TRIALS} kills landed inside the spill"
