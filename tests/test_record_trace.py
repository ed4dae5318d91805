"""Recording the live traffic (`serving.record_trace`, connector/recorder.py) for `kvtier plan`."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import vllm_util as U  # noqa: E402

from kvtier.connector.recorder import TraceRecorder  # noqa: E402
from kvtier.offline.trace import load_trace  # noqa: E402


def _hashes(*names):
    return [n.encode().ljust(32, b"_") for n in names]


def test_lines_are_a_trace_with_keyed_ids(tmp_path):
    p = tmp_path / "t.jsonl"
    r = TraceRecorder(str(p), block_tokens=32, geometry={"block_bytes": 65536, "model": "m1", "kv_dtype": "bf16"})
    now = time.time()
    r.record(now + 1.0, 100, 7, _hashes("a", "b", "c"))       # arrival times 1.5 s apart
    r.record(now + 2.5, 70, 3, _hashes("a", "b"))
    r.close()
    reqs = load_trace(str(p))
    assert reqs.block_tokens == 32 and len(reqs) == 2
    assert reqs.geometry == {"version": 1, "block_tokens": 32, "block_bytes": 65536, "model": "m1", "kv_dtype": "bf16"}
    assert 1400 <= reqs[1].timestamp - reqs[0].timestamp <= 1600   # ages on the monotonic clock
    assert (reqs[0].input_length, reqs[0].output_length) == (100, 7)
    assert reqs[1].hash_ids == reqs[0].hash_ids[:2]          # the shared prefix keeps its ids
    assert all(0 <= h < 1 << 63 for h in reqs[0].hash_ids)
    assert b"a___" not in p.read_bytes()                      # no hash (nor token) in the clear
    assert oct(os.stat(p).st_mode & 0o777) == "0o600"
    # another deployment (another secret) gives other ids for the same hashes
    q = tmp_path / "other" / "t.jsonl"
    q.parent.mkdir()
    r2 = TraceRecorder(str(q), block_tokens=32)
    r2.record(time.time(), 100, 7, _hashes("a", "b", "c"))
    r2.close()
    assert not set(load_trace(str(q))[0].hash_ids) & set(reqs[0].hash_ids)
    # a restart of the same deployment: same ids
    r3 = TraceRecorder(str(tmp_path / "t2.jsonl"), block_tokens=32)
    r3.record(time.time(), 100, 7, _hashes("a", "b", "c"))
    r3.close()
    assert load_trace(str(tmp_path / "t2.jsonl"))[0].hash_ids == reqs[0].hash_ids


def test_a_restart_continues_the_clock(tmp_path, monkeypatch):
    """Timestamps are monotonic across restarts: the second session starts after the first's last
    line even when the wall clock went back (vLLM's arrival times are wall-clock)."""
    p = tmp_path / "t.jsonl"
    r = TraceRecorder(str(p), block_tokens=32)
    r.record(time.time() + 5.0, 64, 1, _hashes("a", "b"))
    r.record(time.time(), 64, 1, _hashes("a", "c"))
    r.close()
    last = max(x.timestamp for x in load_trace(str(p)))
    assert last >= 5000
    wall = time.time()
    monkeypatch.setattr(time, "time", lambda: wall - 3600.0)   # the wall clock set back an hour
    r2 = TraceRecorder(str(p), block_tokens=32)
    r2.record(wall - 3600.0, 64, 1, _hashes("a", "d"))
    r2.close()
    reqs = load_trace(str(p))
    assert len(reqs) == 3 and reqs[2].timestamp > last
    assert p.read_text().count('"kvtier_trace"') == 2          # one header per session


def test_the_prefill_speed_is_measured_over_prefill_only_steps(tmp_path, monkeypatch):
    """Steps that only prefill new requests are timed; a step with decodes in it is not; the
    speed goes into a header line at close, which the reader takes over the first one."""
    clock = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    p = tmp_path / "t.jsonl"
    r = TraceRecorder(str(p), block_tokens=32)
    for new, total, secs in ((200, 200, 0.5), (0, 4, 9.0), (100, 103, 9.0), (300, 300, 0.5)):
        r.step(new, total)
        clock[0] += secs
        r.step_done()
    assert r.prefill_tokens_per_s == 500.0
    r.record(time.time(), 64, 1, _hashes("a", "b"))
    r.close()
    t = load_trace(str(p))
    assert t.geometry["prefill_tokens_per_s"] == 500.0 and t.geometry["prefill_steps"] == 2
    assert p.read_text().count('"kvtier_trace"') == 2 and len(t) == 1


def test_a_missing_directory_is_made_private(tmp_path):
    p = tmp_path / "var" / "lib" / "kvtier" / "trace.jsonl"
    r = TraceRecorder(str(p), block_tokens=32)
    r.record(time.time(), 64, 1, _hashes("a", "b"))
    r.close()
    assert r.active and len(load_trace(str(p))) == 1
    assert oct(os.stat(p.parent).st_mode & 0o777) == "0o700"
    assert oct(os.stat(tmp_path / "var").st_mode & 0o777) == "0o700"


@pytest.mark.parametrize("where", ["file_in_the_way", "proc"])
def test_a_path_it_cannot_record_to_is_one_warning(tmp_path, caplog, where):
    """Never an error at start: one WARNING naming the path the user set, then nothing recorded."""
    if where == "file_in_the_way":
        (tmp_path / "f").write_text("x")
        path = str(tmp_path / "f" / "sub" / "trace.jsonl")
    else:
        path = "/proc/kvtier-test/trace.jsonl"
    counts: dict = {}
    with caplog.at_level(logging.INFO, logger="kvtier.connector"):
        r = TraceRecorder(path, block_tokens=32, count=lambda k, v=1: counts.__setitem__(k, counts.get(k, 0) + v))
        r.record(time.time(), 64, 1, _hashes("a", "b"))
        r.close()
    assert not r.active and counts == {}
    lines = [x for x in caplog.records if x.levelno >= logging.WARNING]
    assert len(lines) == 1 and path in lines[0].getMessage() and "without recording" in lines[0].getMessage()
    assert not os.path.exists(path)


def test_a_read_only_file_system_is_one_warning(caplog):
    import fs_util
    with fs_util.small_fs("8M") as fs:
        fs.remount(read_only=True)
        path = os.path.join(fs.path, "rec", "trace.jsonl")
        with caplog.at_level(logging.WARNING, logger="kvtier.connector"):
            r = TraceRecorder(path, block_tokens=32)
            r.record(time.time(), 64, 1, _hashes("a"))
            r.close()
        assert not r.active
        msgs = [x.getMessage() for x in caplog.records if x.levelno >= logging.WARNING]
        assert len(msgs) == 1 and path in msgs[0] and "EROFS" in msgs[0]


def test_a_full_file_system_never_leaves_a_partial_line(caplog):
    """A real ext4 filled but for 8 KiB: lines of ~20 KB are cut short by the kernel; the recorder
    cuts them back off, counts them, and the file is whole lines that plan and replay read."""
    import fs_util
    with fs_util.small_fs("8M") as fs:
        path = os.path.join(fs.path, "trace.jsonl")
        counts: dict = {}
        r = TraceRecorder(path, block_tokens=32, count=lambda k, v=1: counts.__setitem__(k, counts.get(k, 0) + v))
        r.record(time.time(), 64, 1, _hashes("a", "b"))
        while counts.get("recorded_requests", 0) < 1:
            time.sleep(0.01)
        filler = fs.fill()
        with open(filler, "r+b") as f:            # free two 4 KiB blocks
            f.truncate(os.path.getsize(filler) - 8192)
        with caplog.at_level(logging.WARNING, logger="kvtier.connector"):
            for i in range(5):
                r.record(time.time(), 32 * 900, 1, [b"%032d" % (i * 1000 + j) for j in range(900)])
            r.close(timeout_s=60)
        data = open(path, "rb").read()
        assert data.endswith(b"\n")
        assert [json.loads(x).get("input_length") for x in data.splitlines()] == [None, 64]
        assert counts == {"recorded_requests": 1, "record_errors": 5}
        assert sum("record_trace" in x.getMessage() for x in caplog.records) == 1


def test_a_renamed_or_removed_file_is_reopened_at_its_path(tmp_path, caplog):
    p = tmp_path / "t.jsonl"
    counts: dict = {}
    r = TraceRecorder(str(p), block_tokens=32, count=lambda k, v=1: counts.__setitem__(k, counts.get(k, 0) + v))

    def put(name: str, n: int) -> None:
        r.record(time.time(), 64, 1, _hashes(name, "x"))
        while counts.get("recorded_requests", 0) < n:
            time.sleep(0.01)
    with caplog.at_level(logging.WARNING, logger="kvtier.connector"):
        put("a", 1)
        os.rename(p, tmp_path / "moved.jsonl")
        put("b", 2)
        put("c", 3)
        os.unlink(p)
        put("d", 4)
        r.close()
    assert len(load_trace(str(tmp_path / "moved.jsonl"))) == 1       # nothing more into the renamed file
    assert len(load_trace(str(p))) == 1 and load_trace(str(p)).geometry["block_tokens"] == 32
    warns = [x.getMessage() for x in caplog.records if x.levelno >= logging.WARNING]
    assert len(warns) == 2 and all(str(p) in w and "renamed or removed" in w for w in warns)
    assert counts.get("record_errors", 0) == 0 and counts["record_reopens"] == 2


def test_rotates_by_size(tmp_path):
    p = tmp_path / "t.jsonl"
    r = TraceRecorder(str(p), block_tokens=16, max_bytes=600)
    for i in range(40):
        r.record(time.time(), 16 * 3, 1, _hashes(f"x{i}", "y", "z"))
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
    assert len(load_trace(str(tmp_path / "t.jsonl"))) == 5


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
    lines = p.read_text().splitlines()[1:]                 # after the header
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
    trace = tmp_path / "var" / "lib" / "kvtier" / "trace.jsonl"     # no such directory yet: it is made 0700
    base = U.prompts(6, 3, seed=21)                   # 3 blocks + 5 tokens: no new full block in the output
    order = [0, 1, 2, 0, 3, 1, 4, 5, 0, 2, 3, 4]
    llm = U.make_llm(model, U.kvtier_config(cpu_capacity_blocks=8, record_trace=str(trace)))
    try:
        import kvtier.connector as C
        s = [c for c in C.live_connectors("scheduler") if c.sched is not None][0]
        for i in order:
            U.generate(llm, [base[i]], max_tokens=4)
        served = int(s.sched.totals.get("hit_blocks.cpu", 0))
        bb = s.block_bytes_estimate
    finally:
        U.shutdown(llm)
    reqs = load_trace(str(trace))
    assert len(reqs) == len(order) and reqs.block_tokens == U.BLOCK
    assert oct(os.stat(trace.parent).st_mode & 0o777) == "0o700"
    assert reqs.geometry["block_bytes"] == bb and reqs.geometry["kv_dtype"] == "torch.float32"
    assert served > 0
    cfg = tmp_path / "one.yaml"   # the YAML's own geometry (256 KiB blocks of 512 tokens) is not the server's
    cfg.write_text("block_bytes: 256KiB\ntiers: [{name: cpu, kind: cpu, capacity_blocks: 8}]\n"
                   "policy: {eviction: lru}\n")
    from kvtier.cli.main import main
    capsys.readouterr()
    assert main(["replay", "--trace", str(trace), "--config", str(cfg), "--no-data", "--no-belady", "--json",
                 "-q"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["hit_blocks"] == served
    # planned in the served geometry: 32-token blocks of the server's bytes, said in one line
    assert main(["plan", "--trace", str(trace), "--config", str(cfg), "--no-belady", "--target-hit", "20%",
                 "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert (rep["block_tokens"], rep["block_bytes"]) == (U.BLOCK, bb)
    assert "the trace's geometry" in rep["geometry_note"]
    sug = rep["suggestion"]
    assert f"block_bytes: {bb // 1024}KiB" in sug["yaml"] and "block_tokens: 32" in sug["yaml"]
    assert reqs.geometry["prefill_tokens_per_s"] > 0                  # measured by the server
    assert rep["cost_model"]["prefill_tokens_per_s"] == reqs.geometry["prefill_tokens_per_s"]
    assert rep["cost_model"]["prefill_source"].startswith("measured by the server")
    assert sug["capacity_bytes"]["cpu"] >= sug["capacity_blocks"] * bb
    print(f"served geometry: {U.BLOCK} tokens x {bb} B; plan --target-hit 20%: {sug['summary']}", file=sys.stderr)


@pytest.mark.vllm
@pytest.mark.skipif(not U.vllm_available(), reason="vLLM not installed")
def test_a_path_it_cannot_record_to_never_stops_vllm(tmp_path, caplog):
    """record_trace under a file (the directory cannot be made): the LLM starts and serves, one
    WARNING names the path, nothing is recorded."""
    U.set_env()
    model = U.build_tiny_llama(tmp_path / "m")
    (tmp_path / "f").write_text("x")
    path = str(tmp_path / "f" / "kvtier" / "trace.jsonl")
    with caplog.at_level(logging.WARNING, logger="kvtier.connector"):
        llm = U.make_llm(model, U.kvtier_config(cpu_capacity_blocks=8, record_trace=path))
        try:
            out = U.generate(llm, U.prompts(2, 3, seed=5), max_tokens=4)
        finally:
            U.shutdown(llm)
    assert len(out) == 2 and all(len(o) == 4 for o in out)
    warns = [x.getMessage() for x in caplog.records if "record_trace" in x.getMessage()]
    assert len(warns) == 1 and path in warns[0] and "ENOTDIR" in warns[0]


def test_a_tenant_is_recorded_for_plan():
    """With YAML tenants the scheduler passes each request's tenant label: `kvtier plan` plans per tenant."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "t.jsonl")
        r = TraceRecorder(p, block_tokens=32)
        r.record(time.time(), 64, 1, _hashes("a", "b"), tenant='al"ice')
        r.record(time.time(), 64, 1, _hashes("a", "c"))
        r.close()
        reqs = load_trace(p)
        assert [q.tenant for q in reqs] == ['al"ice', None]
