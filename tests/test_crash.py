"""Crash safety: SIGKILL a writer at random times; after reopen nothing corrupt is served and
every batch reported committed (and not being evicted) is present, byte-exact."""

from __future__ import annotations

import os
import random
import selectors
import signal
import subprocess
import sys
import time

import pytest
import torch

from kvtier.offline.blockgen import block_data, split_block_key
from kvtier.policies.lru import LRU
from kvtier.tiers.nvme import NvmeTier

pytestmark = [pytest.mark.crash, pytest.mark.timeout(240)]

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "crash_worker.py")
SEED = 11
FORK_TRIALS = 40
SUBPROCESS_TRIALS = 2

sys.path.insert(0, HERE)
import crash_worker as cw  # noqa: E402


class Lines:
    """Line reader over a pipe with a timeout."""

    def __init__(self, f) -> None:
        self.f = f
        self.buf = b""
        self.sel = selectors.DefaultSelector()
        self.sel.register(f, selectors.EVENT_READ)

    def next(self, timeout: float = 60.0) -> str | None:
        end = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = end - time.monotonic()
            if left <= 0 or not self.sel.select(left):
                raise TimeoutError(f"no line from the worker in {timeout}s (buffer {self.buf[-200:]!r})")
            chunk = os.read(self.f.fileno(), 65536)
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()

    def drain(self) -> list[str]:
        out = []
        while self.sel.select(0):
            chunk = os.read(self.f.fileno(), 65536)
            if not chunk:
                break
            self.buf += chunk
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            out.append(line.decode())
        return out


def verify(directory: str, lines: list[str]) -> tuple[int, int]:
    """Reopen, read every resident block, check bytes; check reported batches. Returns (resident, checked)."""
    committed, evicting = set(), set()
    for ln in lines:
        if ln.startswith("F "):
            pytest.fail(f"worker failed: {ln}")
        if ln.startswith("C "):
            committed.update(map(int, ln[2:].split(",")))
        elif ln.startswith("E "):
            evicting.update(map(int, ln[2:].split(",")))
    bb = cw.BLOCK_BYTES
    with NvmeTier("verify", directory, cw.CAPACITY, bb, LRU(cw.CAPACITY), io="posix",
                  fingerprint={"model": "crash-test"}) as t:
        keys = t.keys()
        slots = [t.find(k) for k in keys]
        idx = [split_block_key(k)[1] for k in keys]
        assert all(split_block_key(k)[0] == SEED for k in keys)
        out = [torch.empty(bb, dtype=torch.uint8) for _ in keys]
        res = t.read(slots, out).wait()
        assert res.all_ok, res.errors
        assert t.corrupt_blocks == 0
        for i, o in zip(idx, out):
            assert torch.equal(o, block_data(SEED, i, bb)), f"block {i} differs"
        must = committed - evicting
        missing = must - set(idx)
        assert not missing, f"committed blocks lost after SIGKILL: {sorted(missing)}"
        return len(keys), len(must)


def wait_for_open(rd: Lines, pid: int, trial: int, timeout: float = 60.0) -> list[str]:
    """Lines up to and including the child's ``R`` (tier open). A child that fails or stalls fails
    the test with its output; a stalled child's thread stacks go to stderr (SIGUSR1, faulthandler)."""
    lines: list[str] = []
    t0 = time.monotonic()
    while True:
        try:
            ln = rd.next(timeout - (time.monotonic() - t0))
        except TimeoutError:
            os.kill(pid, signal.SIGUSR1)
            time.sleep(1.0)
            os.kill(pid, signal.SIGKILL)
            pytest.fail(f"trial {trial}: child {pid} did not open the tier in {timeout:.0f}s "
                        f"(its stacks are on stderr); its output: {lines[-5:]}")
        assert ln is not None, f"trial {trial}: fork server closed stdout; child output: {lines[-5:]}"
        lines.append(ln)
        if ln.startswith("R "):
            return lines
        if ln.startswith(("F ", "EXIT ")):
            pytest.fail(f"trial {trial}: child {pid} ended before opening the tier: {lines[-5:]}")


def test_sigkill_fork_trials(tmp_path):
    rng = random.Random(int(os.environ.get("KVTIER_CRASH_SEED", "1234")))
    d = str(tmp_path / "tier")
    srv = subprocess.Popen([sys.executable, WORKER, "serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           cwd=os.path.dirname(HERE))
    rd = Lines(srv.stdout)
    try:
        assert rd.next(120) == "READY"
        start, kills, checked = 0, 0, 0
        t0 = time.monotonic()
        for trial in range(FORK_TRIALS):
            srv.stdin.write(f"run {d} {SEED} {start} 1000000\n".encode())
            srv.stdin.flush()
            start += 1_000_000
            lines = []
            ln = rd.next()
            while not ln.startswith("PID "):
                lines.append(ln)
                ln = rd.next()
            pid = int(ln.split()[1])
            if rng.random() < 0.15:
                delay = rng.uniform(0, 0.02)       # often during open / recovery
            else:
                if not any(x.startswith("R ") for x in lines):  # the child may print R before the server's PID
                    lines += wait_for_open(rd, pid, trial)
                delay = rng.uniform(0.0, 0.4)
            time.sleep(delay)
            os.kill(pid, signal.SIGKILL)
            kills += 1
            while not (ln := rd.next()).startswith(f"EXIT {pid}"):
                lines.append(ln)
            status = int(ln.split()[2])
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (ln, lines[-3:])
            _, n = verify(d, lines)
            checked += n
        print(f"\ncrash: {kills} SIGKILL trials (fork server), {checked} committed blocks checked, "
              f"0 corrupt served, {time.monotonic() - t0:.1f}s")
        assert kills == FORK_TRIALS and checked > 0
    finally:
        try:
            srv.stdin.write(b"quit\n")
            srv.stdin.close()
        except OSError:
            pass
        try:
            srv.wait(30)
        except subprocess.TimeoutExpired:
            srv.kill()
            raise


def test_sigkill_fresh_subprocess(tmp_path):
    """The same, with a fresh interpreter per life (slower: imports each time)."""
    rng = random.Random(99)
    d = str(tmp_path / "tier")
    checked = 0
    for trial in range(SUBPROCESS_TRIALS):
        p = subprocess.Popen([sys.executable, WORKER, "run", d, str(SEED), str(trial * 1_000_000)],
                             stdout=subprocess.PIPE, cwd=os.path.dirname(HERE))
        rd = Lines(p.stdout)
        lines = []
        while not (ln := rd.next(120)).startswith("R "):
            lines.append(ln)
        while not (ln := rd.next(120)).startswith("C "):   # the kill lands after a commit, whatever the load
            lines.append(ln)
        lines.append(ln)
        time.sleep(rng.uniform(0.0, 0.4))
        p.send_signal(signal.SIGKILL)
        p.wait(30)
        lines += rd.drain()
        assert p.returncode == -signal.SIGKILL
        assert any(x.startswith("C ") for x in lines), "worker committed nothing before the kill"
        checked += verify(d, lines)[1]
    print(f"\ncrash: {SUBPROCESS_TRIALS} SIGKILL trials (fresh subprocess), {checked} committed blocks checked")
