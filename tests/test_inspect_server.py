"""`kvtier inspect --server`: a live vLLM server read from its own state (no --config), its
counters current within a heartbeat, an exited one "not running (last seen ...)"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import vllm_util as U  # noqa: E402

from kvtier.cli.main import main  # noqa: E402
from kvtier.core import serving_stats  # noqa: E402
from kvtier.core.serving_stats import HEARTBEAT_S, read_servers, write_server_state  # noqa: E402


def _servers(capsys) -> list[dict]:
    capsys.readouterr()
    assert main(["inspect", "--server", "--json"]) == 0
    return json.loads(capsys.readouterr().out)["servers"]


def test_an_exited_server_is_not_running(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVTIER_RUN_DIR", str(tmp_path / "run"))
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(p.stdout)
    write_server_state({"stopped": None, "config": "x.yaml", "geometry": {"block_tokens": 16, "block_bytes": 4096},
                        "tiers": [], "totals": {"n_lookups": 3, "miss_blocks": 5}})
    os.replace(tmp_path / "run" / f"server-{os.getpid()}.json", tmp_path / "run" / f"server-{dead}.json")
    d = json.loads((tmp_path / "run" / f"server-{dead}.json").read_text())
    d["pid"] = dead
    (tmp_path / "run" / f"server-{dead}.json").write_text(json.dumps(d))
    [s] = _servers(capsys)
    assert s["pid"] == dead and s["status"] == "not running"
    assert main(["inspect", "--server", str(dead)]) == 0
    out = capsys.readouterr().out
    assert f"server pid {dead}: not running (last seen " in out and "16-token blocks of 4.00 KiB" in out
    assert oct(os.stat(tmp_path / "run").st_mode & 0o777) == "0o700"
    assert main(["inspect", "--server", "999999999"]) == 2


@pytest.mark.vllm
@pytest.mark.skipif(not U.vllm_available(), reason="vLLM not installed")
def test_a_live_server_is_read_from_its_own_state(tmp_path, monkeypatch, capsys):
    """Requests served, then the server idles: within a heartbeat its state has the scheduler's
    totals exactly, the served geometry (not a YAML's) and its NVMe directory; after shutdown
    it is not running."""
    monkeypatch.setenv("KVTIER_RUN_DIR", str(tmp_path / "run"))
    U.set_env()
    model = U.build_tiny_llama(tmp_path / "m")
    nv = tmp_path / "nv"
    llm = U.make_llm(model, U.kvtier_config(cpu_capacity_blocks=8, nvme_path=str(nv), nvme_capacity_blocks=64,
                                            nvme_io="posix"))
    try:
        import kvtier.connector as C
        sc = [c for c in C.live_connectors("scheduler") if c.sched is not None][0]
        base = U.prompts(3, 3, seed=7)
        for i in (0, 1, 0, 2, 1):
            U.generate(llm, [base[i]], max_tokens=4)
        want = dict(sc.sched.totals)
        t_last = time.time()
        deadline = time.monotonic() + 60                # a heartbeat is 1 s; generous on a loaded machine
        while True:                                     # no request, no step: the heartbeat alone publishes
            [s] = _servers(capsys)
            if s["time"] > t_last + HEARTBEAT_S or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert s["status"] == "serving" and s["pid"] == os.getpid()
        assert s["totals"] == want and s["hits"]["blocks_looked_up"] > 0
        assert s["geometry"]["block_tokens"] == U.BLOCK and s["geometry"]["block_bytes"] == sc.block_bytes_estimate
        assert [t["name"] for t in s["tiers"]] == ["cpu", "nvme"] and s["tiers"][1]["dir"] == str(nv)
        assert main(["inspect", "--server"]) == 0
        out = capsys.readouterr().out
        assert f"server pid {os.getpid()}: serving" in out and f"{U.BLOCK}-token blocks" in out
    finally:
        U.shutdown(llm)
    [s] = read_servers()
    assert s["status"] == "not running" and s["totals"] == dict(sc.sched.totals)
    assert main(["inspect", "--server"]) == 0
    assert f"server pid {os.getpid()}: not running (last seen" in capsys.readouterr().out


def test_states_of_servers_gone_for_a_day_are_pruned(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setattr(serving_stats, "_DONE", set())
    (tmp_path / "run").mkdir(mode=0o700)
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    old, recent = tmp_path / "run" / f"server-{int(p.stdout)}.json", tmp_path / "run" / "server-999999998.json"
    for f in (old, recent):
        f.write_text(json.dumps({"pid": int(f.name[7:-5]), "time": 0, "totals": {}}))
    os.utime(old, (time.time() - 2 * 86400,) * 2)
    write_server_state({"stopped": None, "totals": {}})
    assert not old.exists() and recent.exists()
    assert sorted(s["pid"] for s in read_servers()) == sorted([os.getpid(), 999999998])


def test_a_state_that_cannot_be_written_never_fails_the_server(monkeypatch, caplog):
    """The state `kvtier inspect --server` reads is written from the connector's start, steps and
    stop: a failure there (a tier that cannot say its occupancy, a run directory that cannot be
    written) is one warning and a counter, twice the same cause one warning, never an exception."""
    import logging
    import types

    from kvtier.connector.metrics import SchedulerStats

    counted = []
    sched = types.SimpleNamespace(totals={"blocks_looked_up": 3}, count=lambda k, v=1: counted.append(k),
                                  nvme_tiers=lambda: [])
    me = SchedulerStats(sched, None, None, 16, {})
    me.close()   # no heartbeat thread
    monkeypatch.setattr(SchedulerStats, "_server_state",
                        lambda self, totals, final: (_ for _ in ()).throw(AttributeError("no attribute 'num_used'")))
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        me.publish(force=True)
        me.publish(force=True)
    assert counted == ["state_write_errors", "state_write_errors"]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == \
        ["kvtier: the server's state for kvtier inspect not written: no attribute 'num_used'"]
