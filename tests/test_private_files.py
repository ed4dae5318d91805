"""kvtier's files outside its NVMe tier (run directory, digest cache, handoffs, trace): another local
user cannot plant, redirect or stall them (issue 33 item 4). "Another user" is uid 65534 (the tests
chown as root); a FIFO is what stalls an open. A call that blocked on main runs in a thread here, so
the test fails instead of hanging: the FIFO is then opened from its other end to let it go."""

from __future__ import annotations

import json
import logging
import os
import stat
import threading

import pytest

from kvtier.core import serving_stats
from kvtier.core.identity import DigestStats, weights_digest

OTHER = 65534
BLOCK_S = 30.0   # a few syscalls; only a call stuck on a FIFO takes this long
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


def _unblock(path) -> None:
    for flags in (os.O_RDONLY | os.O_NONBLOCK, os.O_WRONLY | os.O_NONBLOCK):
        try:
            os.close(os.open(str(path), flags))
        except OSError:
            pass


def _returns(fn, *args, fifos=()):
    """fn(*args) run in a thread: its result; the test fails when it blocks (the FIFOs are then released)."""
    box: dict = {}

    def run():
        try:
            box["r"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - raised again in the test
            box["e"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(BLOCK_S)
    if t.is_alive():
        for f in fifos:
            _unblock(f)
        t.join(BLOCK_S)
        pytest.fail(f"{getattr(fn, '__name__', fn)} blocked on a planted FIFO")
    if "e" in box:
        raise box["e"]
    return box.get("r")


def _model(d):
    d.mkdir()
    (d / "config.json").write_text('{"hidden_size": 64}')
    (d / "model.safetensors").write_bytes(bytes(range(256)) * 512)
    return str(d)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    d = tmp_path / "run"
    monkeypatch.setenv("KVTIER_RUN_DIR", str(d))
    monkeypatch.setattr(serving_stats, "_DONE", set())
    return d


# ---- a FIFO planted where kvtier writes or reads: never blocks ------------------------------
def test_a_fifo_at_the_server_state_temp_name_never_blocks(run_dir):
    run_dir.mkdir(mode=0o700)
    fifo = run_dir / f"server-{os.getpid()}.json.tmp"
    os.mkfifo(fifo)
    p = _returns(serving_stats.write_server_state, {"stopped": None, "totals": {"n_lookups": 3}}, fifos=[fifo])
    assert p == str(run_dir / f"server-{os.getpid()}.json")
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
    [s] = serving_stats.read_servers(os.getpid())
    assert s["totals"] == {"n_lookups": 3} and s["status"] == "serving"


def test_a_fifo_at_the_serving_stats_never_blocks(tmp_path):
    nv = tmp_path / "nv"
    nv.mkdir(mode=0o700)
    os.mkfifo(nv / f"{serving_stats.STATS_FILE}.tmp")
    _returns(serving_stats.write_stats, str(nv), {"n_lookups": 2.0}, fifos=[nv / f"{serving_stats.STATS_FILE}.tmp"])
    assert serving_stats.read_stats(str(nv))["totals"] == {"n_lookups": 2.0}
    os.replace(nv / serving_stats.STATS_FILE, nv / "x")
    os.mkfifo(nv / serving_stats.STATS_FILE)
    assert _returns(serving_stats.read_stats, str(nv), fifos=[nv / serving_stats.STATS_FILE]) is None


def test_a_fifo_in_the_digest_cache_never_blocks(tmp_path, caplog):
    model, data = _model(tmp_path / "m"), tmp_path / "data"
    data.mkdir(mode=0o700)
    plain = weights_digest(model)[0]
    fifos = [data / "weights-digests.json", data / f".weights-digests.json.{os.getpid()}.tmp"]
    for f in fifos:
        os.mkfifo(f)
    caplog.set_level(logging.WARNING)
    assert _returns(weights_digest, model, str(data), fifos=fifos)[0] == plain
    [w] = _warnings(caplog)
    assert "digest cache ignored" in w and "weights-digests.json: not a regular file" in w, w
    assert stat.S_ISREG(os.lstat(data / "weights-digests.json").st_mode)     # the FIFO replaced
    st = DigestStats()
    assert weights_digest(model, str(data), st)[0] == plain and (st.files, st.hashed) == (1, 0)   # from the cache


def test_a_fifo_at_the_start_refused_handoff_never_blocks(run_dir, capsys):
    pytest.importorskip("vllm")
    from kvtier.connector import start_check

    run_dir.mkdir(mode=0o700)
    to_parent = run_dir / f"start-refused.{os.getppid()}"
    os.mkfifo(to_parent)
    _returns(start_check.leave_for_parent, "kvtier: error: x.yaml: tiers: bad", fifos=[to_parent])
    assert to_parent.read_text() == "kvtier: error: x.yaml: tiers: bad\n" and stat.S_ISREG(os.lstat(to_parent).st_mode)
    from_child = run_dir / f"start-refused.{os.getpid()}"
    os.mkfifo(from_child)
    _returns(start_check.repeat_a_childs_refusal, fifos=[from_child])
    assert not os.path.lexists(from_child)                                   # removed, never opened
    assert capsys.readouterr().err == ""


def test_a_fifo_as_a_shutdown_report_never_blocks(tmp_path, caplog):
    pytest.importorskip("vllm")
    from kvtier.connector.handoff import read_reports

    os.mkfifo(tmp_path / "shutdown-report.0.json")
    caplog.set_level(logging.WARNING)
    assert _returns(read_reports, str(tmp_path), fifos=[tmp_path / "shutdown-report.0.json"]) is None
    [w] = _warnings(caplog)
    assert "shutdown-report.0.json: not a regular file" in w and not os.listdir(tmp_path)


def test_a_fifo_or_a_symlink_beside_the_trace_is_one_warning(tmp_path, caplog):
    pytest.importorskip("vllm")
    from kvtier.connector.recorder import TraceRecorder

    caplog.set_level(logging.WARNING)
    os.mkfifo(tmp_path / "t.jsonl")
    r = _returns(TraceRecorder, str(tmp_path / "t.jsonl"), 32, fifos=[tmp_path / "t.jsonl"])
    assert not r.active
    [w] = _warnings(caplog)
    assert "t.jsonl" in w and "serving without recording" in w
    caplog.clear()
    other = tmp_path / "other"
    other.mkdir()
    (other / "key").write_bytes(b"k" * 32)           # 32 bytes that are not the deployment's key
    os.symlink(other / "key", other / "record-secret")
    r = TraceRecorder(str(other / "t.jsonl"), 32)
    assert not r.active and not os.path.exists(other / "t.jsonl")
    [w] = _warnings(caplog)
    assert "record-secret" in w and "symlink" in w, w


# ---- a directory kvtier may not write in: one warning, the feature served without it ---------
def test_a_digest_cache_dir_that_is_a_symlink_is_not_written_through(tmp_path, caplog):
    model, elsewhere = _model(tmp_path / "m"), tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    os.symlink(elsewhere, tmp_path / "data")
    caplog.set_level(logging.WARNING)
    assert weights_digest(model, str(tmp_path / "data"))[0] == weights_digest(model)[0]
    assert os.listdir(elsewhere) == []
    [w] = _warnings(caplog)
    assert f"{tmp_path / 'data'}: a symlink; refused" in w, w


@needs_root
@pytest.mark.parametrize("case", ["another user's", "open to all", "under another user's open directory"])
def test_a_data_dir_kvtier_may_not_write_in_is_one_warning_and_hashed_again(tmp_path, caplog, case):
    model = _model(tmp_path / "m")
    plain = weights_digest(model)[0]
    if case == "under another user's open directory":   # its owner could swap `data` for anything
        (tmp_path / "shared").mkdir()
        os.chown(tmp_path / "shared", OTHER, OTHER)
        os.chmod(tmp_path / "shared", 0o777)
        data, why = tmp_path / "shared" / "data", f"{tmp_path / 'shared'} is owned by uid {OTHER}"
    else:
        data = tmp_path / "data"
        data.mkdir()
        os.chmod(data, 0o777 if case == "open to all" else 0o700)
        if case == "another user's":
            os.chown(data, OTHER, OTHER)
        why = f"owned by uid {OTHER}" if case == "another user's" else "writable by group or others (mode 0777)"
    caplog.set_level(logging.WARNING)
    st = DigestStats()
    assert weights_digest(model, str(data), st)[0] == plain and st.hashed == 1
    [w] = _warnings(caplog)
    assert str(data) in w and why in w, w
    written = [os.path.join(r, f) for r, _, fs in os.walk(tmp_path) for f in fs if "digests" in f]
    assert written == []


@needs_root
@pytest.mark.parametrize("owner", ["another user", "this user"])
def test_a_run_dir_open_to_all_is_refused_with_one_warning(run_dir, caplog, owner):
    run_dir.mkdir()
    os.chmod(run_dir, 0o777)
    planted = run_dir / "server-1.json"      # pid 1 "serving": planted by whoever can write there
    planted.write_text(json.dumps({"pid": 1, "time": 1e12, "totals": {}}))
    if owner == "another user":
        os.chown(planted, OTHER, OTHER)
        os.chown(run_dir, OTHER, OTHER)
    caplog.set_level(logging.WARNING)
    for _ in range(2):
        assert serving_stats.write_server_state({"stopped": None, "totals": {}}) is None
    assert serving_stats.read_servers() == []                  # nothing read from it either
    [w] = _warnings(caplog)
    why = f"owned by uid {OTHER}" if owner == "another user" else "writable by group or others"
    assert str(run_dir) in w and why in w, w
    assert sorted(os.listdir(run_dir)) == ["server-1.json"]


# ---- the helper itself --------------------------------------------------------------------
def test_private_dir_creates_0700_writes_0600_and_reads_only_regular_files_of_this_user(tmp_path):
    from kvtier.core.private_files import PrivateDir, UnsafeDir, UnsafeFile

    with PrivateDir.open(str(tmp_path / "a" / "b")) as d:
        assert stat.S_IMODE(os.stat(tmp_path / "a").st_mode) == 0o700 == stat.S_IMODE(os.stat(d.path).st_mode)
        os.mkfifo(d.join(".f.123.0123456789abcdef.tmp"))             # a temp name of a dead writer
        p = d.write("f", b"x" * 10, fsync=True)
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o600 and d.read("f", 10) == b"x" * 10
        assert d.remove_temps(lambda pid: False) == 1 and d.names() == ["f"]
        with pytest.raises(UnsafeFile, match="over the 9"):
            d.read("f", 9)
        os.mkfifo(d.join("fifo"))
        with pytest.raises(UnsafeFile, match="not a regular file"):
            _returns(d.read, "fifo", 10, fifos=[d.join("fifo")])
        os.symlink(p, d.join("link"))
        with pytest.raises(UnsafeFile, match="a symlink"):
            d.read("link", 10)
        assert d.read("absent", 10) is None
    os.symlink(tmp_path / "a", tmp_path / "l")
    with pytest.raises(UnsafeDir, match="a symlink; refused"):
        PrivateDir.open(str(tmp_path / "l"))


def test_the_nvme_bench_never_writes_through_a_planted_symlink(tmp_path):
    from kvtier.cli.bench_nvme import _raw

    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    os.symlink(victim, tmp_path / "raw.bin")
    src, dst = bytearray(1 << 16), bytearray(1 << 16)
    _raw(str(tmp_path / "raw.bin"), memoryview(src), memoryview(dst), 4096, 1, direct=False)
    assert victim.read_bytes() == b"keep" and not os.path.lexists(tmp_path / "raw.bin")
