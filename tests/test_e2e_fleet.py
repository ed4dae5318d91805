"""A fleet inside real vLLM (CPU build): instances in separate OS processes sharing one real
redis-server as their lowest tier (cpu -> nvme -> shared).

Each instance is `tests/fleet_driver.py` in its own process (its own NVMe directory), driven
over JSON lines; the test reads its tokens and the connector's counters from it. Acceptance:
1. B gets, from the shared tier, every block of A's prompts that vLLM would load (exact count),
   and its greedy tokens equal A's and a run without any connector;
2. the server SIGKILLed (or SIGSTOPped: hung, connections open) part-way through B's requests,
   at a point of progress B reports: every request of B, and A's next ones, finish with the
   no-connector tokens, nothing hangs, the failures are counted;
3. a server holding another model's blocks gives no hits.
"""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import vllm_util as U  # noqa: E402

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not U.vllm_available(), reason="vLLM not installed")]

DRIVER = Path(__file__).resolve().parent / "fleet_driver.py"
MT = 8                 # generated tokens per request
STARTUP_S = 300        # deadline for one instance to start (a loaded 2-core machine)
STEP_S = 300           # deadline for one command


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


B = U.BLOCK
# several full blocks each; one a multiple of the block size (its last full block is computed by
# vLLM, never asked for), one a token past a block boundary
SHARE = _prompts([3 * B + 5, 2 * B, 4 * B + 17, 3 * B + 1], seed=11)
KILL = _prompts([3 * B + 7] * 6, seed=12)            # equal lengths: requests finish in waves
OTHER = _prompts([3 * B + 9, 2 * B + 3], seed=13)
_Q = _prompts([4 * B + 5, 2 * B + 5], seed=14)
PART = [_Q[0], _Q[0][:2 * B] + _Q[1]]   # the second shares the first's 2 leading blocks


def _asked(p: list[int]) -> int:
    """Blocks vLLM asks the connector for: full blocks, at least one token left to compute."""
    return (len(p) - 1) // B


def _stored(p: list[int]) -> int:
    """Full blocks a request computes (prompt and generated tokens but the last one)."""
    return (len(p) + MT - 1) // B


# ---- instances -----------------------------------------------------------------------------

class Instance:
    """One vLLM process (fleet_driver.py); `ask` sends a command and returns its answer."""

    def __init__(self, name: str, log_dir: Path, model: str, kv: dict | None, max_num_seqs: int = 8,
                 prefix_caching: bool = False):
        self.name = name
        self.log = log_dir / f"{name}.log"
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
                   VLLM_LOGGING_LEVEL="WARNING", PYTHONUNBUFFERED="1")
        args = {"model": model, "kv": kv, "max_num_seqs": max_num_seqs, "prefix_caching": prefix_caching}
        self._logf = open(self.log, "w")
        self.proc = subprocess.Popen([sys.executable, str(DRIVER), json.dumps(args)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._logf, text=True, env=env)
        self._q: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._q.put(line)
        self._q.put(None)

    def _tail(self) -> str:
        try:
            return "".join(self.log.read_text(errors="replace").splitlines(True)[-40:])
        except OSError:
            return ""

    def recv(self, timeout_s: float = STEP_S) -> dict:
        try:
            line = self._q.get(timeout=timeout_s)
        except queue.Empty:
            pytest.fail(f"instance {self.name}: no answer in {timeout_s} s; log tail:\n{self._tail()}")
        if line is None:
            self.proc.wait(30)
            pytest.fail(f"instance {self.name} exited ({self.proc.returncode}); log tail:\n{self._tail()}")
        return json.loads(line)

    def send(self, obj: dict | str) -> None:
        self.proc.stdin.write((obj if isinstance(obj, str) else json.dumps(obj)) + "\n")
        self.proc.stdin.flush()

    def ask(self, obj: dict, timeout_s: float = STEP_S) -> dict:
        self.send(obj)
        return self.recv(timeout_s)

    def ready(self) -> "Instance":
        assert self.recv(STARTUP_S) == {"ready": True}
        return self

    def generate(self, prompts, **kw) -> tuple[list[list[int]], dict]:
        r = self.ask({"op": "generate", "prompts": prompts, "max_tokens": MT, **kw})
        return r["tokens"], r["stats"]

    def quit(self) -> dict:
        r = self.ask({"op": "quit"})
        assert r["bye"]
        self.proc.wait(60)
        return r["stats"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._logf.close()


@pytest.fixture
def instances(tmp_path):
    made: list[Instance] = []

    def start(name, model, kv=None, **kw) -> Instance:
        inst = Instance(name, tmp_path, model, kv, **kw)
        made.append(inst)
        return inst

    yield start
    for inst in made:
        inst.close()


def _yaml(path: Path, url: str, nvme_dir: Path, timeout_s: float = 1.0) -> str:
    """The shipped fleet stack (configs/cpu-nvme-redis.yaml) with small capacities."""
    path.write_text(f"""\
block_bytes: 32KiB
tiers:
  - {{name: cpu, kind: cpu, capacity: 2MiB}}
  - {{name: nvme, kind: nvme, path: "{nvme_dir}", capacity: 8MiB, io: auto}}
  - name: shared
    kind: redis
    url: "{url}"
    timeout_s: {timeout_s}
    connect_timeout_s: {timeout_s}
    admission: all
policy: {{eviction: lru, admission: all, promotion: inclusive, demotion: write_back}}
""")
    return str(path)


def _kv(tmp_path: Path, name: str, url: str, **kw) -> dict:
    """A live server answers within 5 s whatever the load (a per-command timeout is only the
    longest wait on a dead or stuck server)."""
    kw.setdefault("timeout_s", 5.0)
    return {"config": _yaml(tmp_path / f"{name}.yaml", url, tmp_path / name, **kw)}


def _keys(server) -> int:
    c = server.client()
    try:
        return sum(1 for _ in c.scan_iter(match="kvt:*", count=1000))
    finally:
        c.close()


# ---- shared fixtures -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    U.set_env()
    d = tmp_path_factory.mktemp("fleet-models")
    return U.build_tiny_llama(d / "seed0", seed=0), U.build_tiny_llama(d / "seed1", seed=1)


@pytest.fixture(scope="module")
def baseline(models, tmp_path_factory):
    """Tokens without any connector: model 0 for SHARE and KILL, model 1 for OTHER."""
    log = tmp_path_factory.mktemp("fleet-baseline")
    out = {}
    insts = [Instance(f"baseline{i}", log, models[i], None) for i in (0, 1)]
    try:
        for inst in insts:
            inst.ready()
        for i, sets in ((0, ("SHARE", "KILL", "PART")), (1, ("OTHER",))):
            for name in sets:
                out[name] = insts[i].generate(globals()[name])[0]
            insts[i].quit()
    finally:
        for inst in insts:
            inst.close()
    return out


# ---- the tests -----------------------------------------------------------------------------

@pytest.mark.timeout(900)
def test_two_instances_share(models, baseline, instances, redis_factory, tmp_path):
    server = redis_factory(maxmemory="64mb")
    # vLLM's own prefix cache on, as served by default (its block hashes are the keys)
    a = instances("A", models[0], _kv(tmp_path, "a", server.url), prefix_caching=True)
    b = instances("B", models[0], _kv(tmp_path, "b", server.url), prefix_caching=True)
    a.ready()
    b.ready()

    toks_a, st = a.generate(SHARE)
    assert st["sched"].get("hit_tokens", 0) == 0
    st = a.ask({"op": "drain"})["stats"]
    stored = sum(_stored(p) for p in SHARE)
    assert _keys(server) == stored * U.PARTS   # every computed block written through, one value per part
    assert st["worker"]["blocks_stored.cpu"] == stored

    toks_b, st = b.generate(SHARE)
    want = sum(_asked(p) for p in SHARE)
    sched = st["sched"]
    assert sched["hit_blocks.shared"] == want, sched
    assert sched.get("hit_blocks.cpu", 0) == 0 and sched.get("hit_blocks.nvme", 0) == 0
    assert sched["hit_tokens"] == want * B
    assert st["worker"]["blocks_loaded.shared"] == want
    assert sched.get("gone_blocks.shared", 0) == 0 and sched.get("lookup_failures.shared", 0) == 0
    assert toks_b == toks_a == baseline["SHARE"]
    print(f"\nshare: {stored} blocks on the server from A; B: hit_blocks.shared {sched['hit_blocks.shared']} "
          f"of {want} asked")
    a.quit()
    b.quit()
    # what `kvtier inspect` shows: the totals B's scheduler left in its NVMe directory at shutdown
    from kvtier.core.serving_stats import hit_ratios, read_stats
    saved = read_stats(str(tmp_path / "b"))
    assert saved is not None and saved["totals"]["hit_blocks.shared"] == want
    assert hit_ratios(saved)["hit_ratio_by_tier"]["shared"] == 1.0


@pytest.mark.timeout(900)
@pytest.mark.parametrize("how,loads", [("kill", "in_step"), ("stop", "in_step"), ("kill", "async")])
def test_server_killed_mid_run(models, baseline, instances, redis_factory, tmp_path, how, loads):
    """in_step: B reads the shared tier in the step that needs it, so what it planned to read after
    the kill is gone at load. async (the default): vLLM parks every waiting request while its
    blocks arrive, so B's reads all start before the pause; the kill then hits its later lookups
    and writes."""
    server = redis_factory(maxmemory="64mb")
    a = instances("A", models[0], _kv(tmp_path, "a", server.url, timeout_s=0.5))
    # two running at a time: B's requests finish in waves, the server dies between waves
    kv_b = _kv(tmp_path, "b", server.url, timeout_s=0.5)
    kv_b["async_shared_loads"] = loads == "async"
    b = instances("B", models[0], kv_b, max_num_seqs=2)
    a.ready()
    b.ready()
    toks_a, _ = a.generate(KILL)
    a.ask({"op": "drain"})
    assert _keys(server) == sum(_stored(p) for p in KILL) * U.PARTS

    b.send({"op": "generate", "prompts": KILL, "max_tokens": MT, "pause_after": 2})
    assert b.recv() == {"paused": 2}
    if how == "kill":
        server.kill()                       # SIGKILL, B paused between its waves
    else:
        os.kill(server.pid, signal.SIGSTOP)   # hung: connections open, nothing answers
    b.send("go")
    r = b.recv()
    toks_b, st = r["tokens"], r["stats"]
    assert toks_b == toks_a == baseline["KILL"]          # recomputed what the dead server could not give
    sched, worker = st["sched"], st["worker"]
    # B's lookups were answered before the kill (vLLM asks for every waiting request at once);
    # what B planned to read after the kill is a handled miss: gone, recomputed, counted
    assert sched["hit_blocks.shared"] == worker.get("blocks_loaded.shared", 0) + sched.get("gone_blocks.shared", 0)
    assert worker.get("blocks_load_failed.shared", 0) == sched.get("gone_blocks.shared", 0)
    if loads == "in_step":
        assert sched.get("gone_blocks.shared", 0) + sched.get("lookup_failures.shared", 0) \
            + sched.get("lookup_timeouts.shared", 0) > 0, sched
        # at most the requests running when B paused had loaded (two, or four if vLLM scheduled
        # the next wave in the step that finished the first): the last ones cannot have been served
        assert worker.get("blocks_loaded.shared", 0) <= 4 * _asked(KILL[0])
        assert worker.get("unreachable.shared", 0) + sched.get("unreachable.shared", 0) > 0, (sched, worker)
    print(f"\n{how}, B:", {k: v for k, v in sched.items() if "shared" in k or "fail" in k},
          {k: v for k, v in worker.items() if "shared" in k})

    # new prompts on B with the server dead: lookups fail fast (counted), nothing is served
    hits = sched["hit_blocks.shared"]
    toks_b2, st = b.generate(SHARE)
    assert toks_b2 == baseline["SHARE"]
    sched = st["sched"]
    assert sched["hit_blocks.shared"] == hits
    assert sched.get("lookup_failures.shared", 0) + sched.get("lookup_timeouts.shared", 0) > 0, sched
    assert st["shared"]["server_down"] is True
    assert st["worker"].get("unreachable.shared", 0) + sched.get("unreachable.shared", 0) > 0, st

    # A goes on with the server dead: its writes to the server fail, counted; tokens unchanged
    toks_a2, st = a.generate(SHARE)
    assert toks_a2 == baseline["SHARE"]
    assert st["sched"].get("store_failed_blocks.shared", 0) == sum(_stored(p) for p in SHARE), st["sched"]
    assert st["worker"].get("put_failed_blocks.shared", 0) + st["worker"].get("put_skipped_blocks.shared", 0) \
        == sum(_stored(p) for p in SHARE) * U.PARTS, st["worker"]   # the worker counts each part's value
    print(f"{how}, B after:", {k: v for k, v in sched.items() if "shared" in k or "fail" in k},
          "A after:", {k: v for k, v in st["sched"].items() if "shared" in k or "fail" in k})
    a.quit()                                # shutdown with the server dead or hung: bounded
    b.quit()
    server.kill()                           # a stopped server ignores SIGTERM


@pytest.mark.timeout(900)
def test_other_models_entries_give_no_hits(models, baseline, instances, redis_factory, tmp_path):
    server = redis_factory(maxmemory="64mb")
    a = instances("A", models[0], _kv(tmp_path, "a", server.url))
    b = instances("B", models[1], _kv(tmp_path, "b", server.url))
    a.ready()
    b.ready()
    a.generate(OTHER)
    a.ask({"op": "drain"})
    n = _keys(server)
    assert n == sum(_stored(p) for p in OTHER) * U.PARTS

    toks_b, st = b.generate(OTHER)
    sched = st["sched"]
    assert sched.get("hit_blocks.shared", 0) == 0 and sched.get("hit_tokens", 0) == 0, sched
    assert toks_b == baseline["OTHER"]
    st = b.ask({"op": "drain"})["stats"]
    assert _keys(server) == 2 * n            # B wrote its own blocks under its own namespace
    a.quit()
    b.quit()


@pytest.mark.timeout(900)
def test_failed_shared_load_stores_nothing_computed_over_it(models, baseline, instances, redis_factory, tmp_path):
    """A load from the shared tier fails (server killed between B's lookup and its load): vLLM
    recomputes, but the blocks computed in that very step attended over the unloaded blocks.
    They must not be stored: a later hit on them would serve wrong KV (and the fleet with it)."""
    server = redis_factory(maxmemory="64mb")
    a = instances("A", models[0], _kv(tmp_path, "a", server.url, timeout_s=0.5))
    b = instances("B", models[0], _kv(tmp_path, "b", server.url, timeout_s=0.5), max_num_seqs=1)
    a.ready()
    b.ready()
    a.generate(PART[:1])
    a.ask({"op": "drain"})
    q = PART[1]                             # its 2 leading blocks are on the server, not the next 2
    # one request at a time: q waits (its lookup answered: 2 blocks) while another runs
    b.send({"op": "generate", "prompts": [OTHER[1], q], "max_tokens": MT, "pause_tokens": 2})
    assert b.recv() == {"paused": 0}
    server.kill()
    b.send("go")
    r = b.recv()
    assert r["tokens"][1] == baseline["PART"][1]
    assert r["stats"]["sched"]["gone_blocks.shared"] == 2, r["stats"]["sched"]
    toks, st = b.generate([q])              # blocks 0-1 recomputed (server dead) and stored
    assert toks == [baseline["PART"][1]]
    toks, st = b.generate([q])              # all 4 asked blocks from B's DRAM
    assert st["sched"]["hit_blocks.cpu"] >= 4, st["sched"]
    assert toks == [baseline["PART"][1]]
    a.quit()
    b.quit()


@pytest.mark.timeout(900)
def test_corrupt_values_are_read_once(models, baseline, instances, redis_factory, tmp_path):
    """Every value A wrote is truncated by one byte on the server. B's requests hit them all: each
    bad value is read once (its load fails, vLLM recomputes), deleted and remembered, so the
    rescheduled request's lookup misses it: generate() returns (was: an endless loop of failed
    loads) with the no-connector tokens, and B's recomputed blocks replace the bad values."""
    server = redis_factory(maxmemory="64mb")
    a = instances("A", models[0], _kv(tmp_path, "a", server.url))
    b = instances("B", models[0], _kv(tmp_path, "b", server.url))
    a.ready()
    b.ready()
    a.generate(SHARE)
    a.ask({"op": "drain"})
    cl = server.client()
    names = list(cl.scan_iter(match="kvt:*", count=1000))
    size = len(cl.get(names[0]))
    for n in names:
        cl.set(n, cl.get(n)[:-1])
    r = b.ask({"op": "generate", "prompts": SHARE, "max_tokens": MT}, timeout_s=300)  # old code: loops
    sched, worker = r["stats"]["sched"], r["stats"]["worker"]
    assert r["tokens"] == baseline["SHARE"]
    want = sum(_asked(p) for p in SHARE)
    assert sched["hit_blocks.shared"] == want, sched          # each planned once, none again
    # each read once: the worker counts each part's value, the scheduler each block
    assert worker["corrupt_blocks.shared"] == U.PARTS * sched["bad_blocks.shared"] == U.PARTS * want, worker
    assert sched["load_failed_requests"] == len(SHARE)        # each request rescheduled once
    st = b.ask({"op": "drain"})["stats"]
    assert st["shared"]["bad_marked_blocks"] == 0            # B wrote them again: the marks cleared
    assert sorted(len(cl.get(n) or b"") for n in names) == [size] * len(names)  # good values again
    cl.close()
    a.quit()
    b.quit()
