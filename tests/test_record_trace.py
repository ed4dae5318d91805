"""Recording the live traffic (`serving.record_trace`, connector/recorder.py) for `kvtier plan`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import vllm_util as U  # noqa: E402

from kvtier.connector.recorder import TraceRecorder  # noqa: E402
from kvtier.offline.trace import load_trace  # noqa: E402


def _hashes(*names):
    return [n.encode().ljust(32, b"_") for n in names]


def test_lines_are_a_trace_with_keyed_ids(tmp_path):
    p = tmp_path / "t.jsonl"
    r = TraceRecorder(str(p), block_tokens=32)
    r.record(r._t0 + 0.5, 100, 7, _hashes("a", "b", "c"))
    r.record(r._t0 + 1.25, 70, 3, _hashes("a", "b"))
    r.close()
    reqs = load_trace(str(p))
    assert reqs.block_tokens == 32 and len(reqs) == 2
    assert [x.timestamp for x in reqs] == [500, 1250]
    assert (reqs[0].input_length, reqs[0].output_length) == (100, 7)
    assert reqs[1].hash_ids == reqs[0].hash_ids[:2]          # the shared prefix keeps its ids
    assert all(0 <= h < 1 << 63 for h in reqs[0].hash_ids)
    assert b"a___" not in p.read_bytes()                      # no hash (nor token) in the clear
    assert oct(os.stat(p).st_mode & 0o777) == "0o600"
    # another deployment (another secret) gives other ids for the same hashes
    q = tmp_path / "other" / "t.jsonl"
    q.parent.mkdir()
    r2 = TraceRecorder(str(q), block_tokens=32)
    r2.record(r2._t0, 100, 7, _hashes("a", "b", "c"))
    r2.close()
    assert not set(load_trace(str(q))[0].hash_ids) & set(reqs[0].hash_ids)
    # a restart of the same deployment: same ids
    r3 = TraceRecorder(str(tmp_path / "t2.jsonl"), block_tokens=32)
    r3.record(r3._t0, 100, 7, _hashes("a", "b", "c"))
    r3.close()
    assert load_trace(str(tmp_path / "t2.jsonl"))[0].hash_ids == reqs[0].hash_ids


def test_rotates_by_size(tmp_path):
    p = tmp_path / "t.jsonl"
    r = TraceRecorder(str(p), block_tokens=16, max_bytes=600)
    for i in range(40):
        r.record(r._t0, 16 * 3, 1, _hashes(f"x{i}", "y", "z"))
    r.close()
    assert p.stat().st_size <= 600 and (tmp_path / "t.jsonl.1").stat().st_size <= 600
    n = len(load_trace(str(p))) + len(load_trace(str(tmp_path / "t.jsonl.1")))
    assert 0 < n < 40 and r._count is not None


def test_a_full_queue_drops_and_counts(tmp_path, monkeypatch):
    """The writer held inside one write: at most QUEUE_MAX requests wait, the rest are dropped and
    counted; every waiting one is written once the writer goes on."""
    import threading

    import kvtier.connector.recorder as R
    monkeypatch.setattr(R, "QUEUE_MAX", 4)
    counts: dict = {}
    r = TraceRecorder(str(tmp_path / "t.jsonl"), block_tokens=32,
                      count=lambda k, v=1: counts.__setitem__(k, counts.get(k, 0) + v))
    entered, go = threading.Event(), threading.Event()
    write = r._write

    def held(rec):
        entered.set()
        assert go.wait(60)
        write(rec)
    r._write = held
    r.record(0.0, 32, 1, [b"%032d" % 0])
    assert entered.wait(60)                      # the writer holds the first request
    for i in range(1, 11):
        r.record(0.0, 32, 1, [b"%032d" % i])
    assert counts == {"record_dropped_requests": 6}
    go.set()
    r.close(timeout_s=60)
    assert counts == {"record_dropped_requests": 6, "recorded_requests": 5}
    assert len((tmp_path / "t.jsonl").read_text().splitlines()) == 5


def test_sigterm_mid_recording_leaves_a_valid_file(tmp_path):
    """A process recording as fast as it can is sent SIGTERM (its handler closes the recorder, as
    vLLM's shutdown does): every line of the file parses, and there are some."""
    p = tmp_path / "t.jsonl"
    code = textwrap.dedent(f"""
        import os, signal, sys, time
        from kvtier.connector.recorder import TraceRecorder
        r = TraceRecorder({str(p)!r}, block_tokens=32)
        def stop(*_):
            r.close()
            sys.exit(0)
        signal.signal(signal.SIGTERM, stop)
        print("ready", flush=True)
        i = 0
        while True:
            r.record(time.time(), 96, 4, [b"%032d" % i, b"%032d" % (i + 1), b"%032d" % (i + 2)])
            i += 1
            if i % 64 == 0:
                time.sleep(0.001)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    while not p.exists() or p.stat().st_size < 20000:   # progress, not time: some lines are written
        assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    lines = p.read_text().splitlines()
    assert len(lines) > 10 and all(json.loads(x)["input_length"] == 96 for x in lines)
    assert len(load_trace(str(p))) == len(lines)


# ---- in real vLLM: the recorded trace, replayed, gives the hits the connector saw -------------
@pytest.mark.vllm
@pytest.mark.skipif(not U.vllm_available(), reason="vLLM not installed")
def test_recorded_trace_replays_to_the_servers_hits(tmp_path, capsys):
    """Prompts one at a time (prefix caching off, so every hit is kvtier's), then the recorded
    trace through `kvtier replay` on the same one-tier stack: the same hit blocks."""
    U.set_env()
    model = U.build_tiny_llama(tmp_path / "m")
    trace = tmp_path / "rec" / "trace.jsonl"
    trace.parent.mkdir()
    base = U.prompts(6, 3, seed=21)                   # 3 blocks + 5 tokens: no new full block in the output
    order = [0, 1, 2, 0, 3, 1, 4, 5, 0, 2, 3, 4]
    llm = U.make_llm(model, U.kvtier_config(cpu_capacity_blocks=8, record_trace=str(trace)))
    try:
        import kvtier.connector as C
        s = [c for c in C.live_connectors("scheduler") if c.sched is not None][0]
        for i in order:
            U.generate(llm, [base[i]], max_tokens=4)
        served = int(s.sched.totals.get("hit_blocks.cpu", 0))
    finally:
        U.shutdown(llm)
    reqs = load_trace(str(trace))
    assert len(reqs) == len(order) and reqs.block_tokens == U.BLOCK
    assert served > 0
    cfg = tmp_path / "one.yaml"
    cfg.write_text("block_tokens: 32\ntiers: [{name: cpu, kind: cpu, capacity_blocks: 8}]\npolicy: {eviction: lru}\n")
    from kvtier.cli.main import main
    capsys.readouterr()
    assert main(["replay", "--trace", str(trace), "--config", str(cfg), "--no-data", "--no-belady", "--json",
                 "-q"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["hit_blocks"] == served
