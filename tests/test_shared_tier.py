"""The shared tier on a real redis-server (and a real 3-node Redis Cluster): round trips through
the controller, namespaces, values that must never be served, a dead server, AUTH and TLS."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from kvtier.core.config import parse_config
from kvtier.core.stack import TierStack
from kvtier.tiers.shared_conn import Namespace, RedisSettings
from kvtier.tiers.shared_data import SharedData

BB = 64 << 10
N = 24


def _cfg(url: str, cpu: int = 8, model: str = "m", **shared):
    t = {"name": "shared", "kind": "redis", "url": url, "timeout_s": 0.5, "connect_timeout_s": 0.5, **shared}
    return parse_config({"block_bytes": BB, "model": model, "tiers": [
        {"name": "cpu", "kind": "cpu", "capacity_blocks": cpu}, t]}, check_env=False)


def _keys(tag: str, n: int = N) -> list[bytes]:
    return [f"{tag}-{i:04d}".encode().ljust(16, b".") for i in range(n)]


def _blocks(n: int = N, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 255, (BB,), dtype=torch.uint8, generator=g) for _ in range(n)]


def _fresh_get(cfg, keys):
    """A new stack (empty DRAM, as another instance): serve `keys`, return (served, buffers, totals)."""
    with TierStack.from_config(cfg) as st:
        out = [torch.zeros(BB, dtype=torch.uint8) for _ in keys]
        n = st.get(keys, out)
        return n, out, dict(st.ctrl.totals)


def test_blocks_of_one_instance_serve_another(redis_server):
    cfg = _cfg(redis_server.url)
    keys, data = _keys("share"), _blocks()
    with TierStack.from_config(cfg) as st:
        assert st.put(keys, data) == N
        assert st.ctrl.totals["stored_blocks.shared"] == N
    n, out, tot = _fresh_get(cfg, keys)
    assert n == N and all(torch.equal(a, b) for a, b in zip(out, data))
    assert tot["hit_blocks.shared"] == N
    # promotion brought what fits into DRAM (all or nothing per op: 24 > 8 blocks here: none)
    assert tot.get("promoted_blocks.cpu", 0) in (0, N)


def test_another_model_or_rank_never_shares(redis_server):
    keys, data = _keys("ns"), _blocks()
    with TierStack.from_config(_cfg(redis_server.url, model="a")) as st:
        st.put(keys, data)
    with TierStack.from_config(_cfg(redis_server.url, model="b")) as st:
        assert st.lookup(keys) == 0
    a = Namespace(_cfg(redis_server.url, model="a").fingerprint())
    assert a.name(keys[0], 0) != a.name(keys[0], 1)  # ranks keep their own shards


def test_cluster_round_trip(redis_cluster):
    cfg = _cfg(redis_cluster.url, cluster=True)
    keys, data = _keys("cluster", 48), _blocks(48, 1)
    with TierStack.from_config(cfg) as st:
        assert st.put(keys, data) == 48
    n, out, tot = _fresh_get(cfg, keys)
    assert n == 48 and all(torch.equal(a, b) for a, b in zip(out, data))
    ns = Namespace(cfg.fingerprint())
    per_node = [sum(1 for _ in node.client().scan_iter(match=ns.pattern())) for node in redis_cluster.nodes]
    assert sum(per_node) == 48 and all(per_node), per_node  # spread over the three masters


def _data_plane(url: str, secret: str | None = None, model: str = "m") -> SharedData:
    cfg = _cfg(url, model=model, secret=secret)
    return SharedData(RedisSettings.of(cfg.tiers[1]), Namespace(cfg.fingerprint(), secret), BB)


@pytest.mark.parametrize("damage", ["truncated", "flipped", "planted", "swapped", "foreign_model", "garbage"])
def test_bad_values_are_misses_never_bytes(redis_server, damage):
    """A value under our key that is not exactly the block we wrote: a miss and a counter; the
    destination buffer is left untouched; the stack's prefix ends before it."""
    keys, data = _keys("bad-" + damage, 4), _blocks(4, 2)
    cfg = _cfg(redis_server.url, secret="fleet-secret")
    with TierStack.from_config(cfg) as st:
        st.put(keys, data)
    rd = _data_plane(redis_server.url, "fleet-secret")
    cl = redis_server.client()
    name = rd.ns.name(keys[2])
    good = cl.get(name)
    if damage == "truncated":
        bad = good[:-100]
    elif damage == "flipped":
        bad = bytearray(good)
        bad[-1] ^= 1
    elif damage == "planted":  # well-formed, sealed without the fleet's secret
        bad = _data_plane(redis_server.url, "other-secret").seal(keys[2], data[2])
    elif damage == "swapped":  # another block's genuine value
        bad = cl.get(rd.ns.name(keys[1]))
    elif damage == "foreign_model":  # genuine for another fingerprint, copied under our name
        other = _data_plane(redis_server.url, "fleet-secret", model="other")
        bad = other.seal(keys[2], data[2])
    else:
        bad = b"\x00" * 10
    cl.set(name, bytes(bad))
    dst = [torch.full((BB,), 7, dtype=torch.uint8) for _ in keys]
    r = rd.read((), dst, keys).wait()
    assert r.ok == [True, True, False, True]
    assert torch.equal(dst[2], torch.full((BB,), 7, dtype=torch.uint8))
    assert rd.counters["corrupt_blocks"] == 1
    assert rd.counters["bad_deleted_blocks"] == 1 and not cl.exists(name)  # read once, deleted
    rd.close()
    n, out, tot = _fresh_get(cfg, keys)
    assert n == 2 and "gone_blocks.shared" not in tot
    assert all(torch.equal(a, b) for a, b in zip(out[:2], data[:2]))


def test_found_then_evicted_is_a_handled_miss(redis_server):
    keys, data = _keys("gone"), _blocks()
    cfg = _cfg(redis_server.url)
    with TierStack.from_config(cfg) as st:
        st.put(keys, data)
    with TierStack.from_config(cfg) as st:
        assert st.lookup(keys) == N
        redis_server.client().delete(Namespace(cfg.fingerprint()).name(keys[5]))  # the server evicts it
        out = [torch.zeros(BB, dtype=torch.uint8) for _ in keys]
        assert st.get(keys, out) == 5
        assert st.ctrl.totals["gone_blocks.shared"] == 1
        assert st.tiers[1].stats()["missing_blocks"] == 1
        assert not st.tiers[1].holds(keys[5])  # a later store puts it again
        assert st.put(keys[5:6], data[5:6]) == 1 and st.ctrl.totals["stored_blocks.shared"] == 1


def test_lookup_does_not_wait_for_the_server(redis_server):
    """wait=False (the vLLM scheduler): None while the answer is on its way, then the count."""
    keys, data = _keys("async"), _blocks()
    cfg = _cfg(redis_server.url)
    with TierStack.from_config(cfg) as st:
        st.put(keys, data)
    with TierStack.from_config(cfg) as st:
        tier = st.tiers[1]
        assert tier.lookup(keys, wait=False) is None
        deadline = time.monotonic() + 30
        while (n := tier.lookup(keys, wait=False)) is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert n == N
        assert tier.lookup(keys, wait=False) == N  # known now: answered at once


def test_dead_server_gives_misses_one_warning_and_recovers(redis_factory, caplog):
    srv = redis_factory()
    keys, data = _keys("dead"), _blocks()
    cfg = _cfg(srv.url)
    caplog.set_level(logging.INFO, logger="kvtier")
    with TierStack.from_config(cfg) as st:
        st.put(keys, data)
        srv.kill()
        other = _keys("dead-other")
        for _ in range(3):  # unknown keys: the server must be asked
            assert st.lookup(other) == 0
        assert st.put(_keys("dead-new", 4), _blocks(4, 3)) == 4  # DRAM takes it; the server write fails
        tot = st.ctrl.totals
        assert tot["unreachable.shared"] >= 1
        assert tot.get("store_failed_blocks.shared", 0) + tot.get("put_skipped_blocks.shared", 0) >= 4
        warnings = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        srv.restart()  # empty (no persistence)
        deadline = time.monotonic() + 90  # the breaker retries with backoff (<= 30 s)
        while st.tiers[1].conn.breaker.down:
            st.lookup(other)  # asks the server at most once per backoff period
            assert time.monotonic() < deadline, "no reconnection"
            time.sleep(0.1)
        before = st.ctrl.totals.get("stored_blocks.shared", 0)
        assert st.put(other[:4], _blocks(4, 5)) == 4
        assert st.ctrl.totals["stored_blocks.shared"] == before + 4
    assert any("answers again" in r.getMessage() for r in caplog.records)


def test_password_and_acl_user(redis_factory, caplog):
    caplog.set_level(logging.DEBUG, logger="kvtier")
    srv = redis_factory(password="s3cret-pw")
    keys, data = _keys("auth"), _blocks()
    bare = f"redis://{srv.host}:{srv.port}/0"  # credentials from the config, not the url
    good = _cfg(bare, password="s3cret-pw")
    with TierStack.from_config(good) as st:
        assert st.put(keys, data) == N and st.lookup(keys) == N
    bad = _cfg(good.tiers[1].url, password="wrong-pw")
    with TierStack.from_config(bad) as st:
        assert st.lookup(_keys("auth-x")) == 0
        assert st.ctrl.totals["unreachable.shared"] >= 1
    assert not any("s3cret-pw" in r.getMessage() or "wrong-pw" in r.getMessage() for r in caplog.records)
    acl = redis_factory(acl_user=("alice", "alice-pw"))
    cfg = _cfg(f"redis://{acl.host}:{acl.port}/0", username="alice", password="alice-pw")
    with TierStack.from_config(cfg) as st:
        assert st.put(keys, data) == N and st.lookup(keys) == N
    with TierStack.from_config(_cfg(acl.url)) as st:  # the same, credentials in the url
        assert st.lookup(_keys("acl-url")) == 0 and not st.tiers[1].conn.breaker.down


def test_tls(redis_factory):
    srv = redis_factory(tls=True)
    assert srv.url.startswith("rediss://")
    keys, data = _keys("tls"), _blocks()
    cfg = _cfg(srv.url, tls_ca=srv.ca_path)
    with TierStack.from_config(cfg) as st:
        assert st.put(keys, data) == N
    n, out, _ = _fresh_get(cfg, keys)
    assert n == N and all(torch.equal(a, b) for a, b in zip(out, data))


def test_second_hit_admission_spares_the_network(redis_server):
    cfg = _cfg(redis_server.url, cpu=64, admission="second_hit")
    keys, data = _keys("adm", 4), _blocks(4, 4)
    with TierStack.from_config(cfg) as st:
        st.put(keys, data)
        assert st.ctrl.totals.get("stored_blocks.shared", 0) == 0
        assert st.ctrl.totals["not_admitted_blocks.shared"] == 4
        st.clear()
        st.put(keys, data)  # seen again: now worth sharing
        assert st.ctrl.totals["stored_blocks.shared"] == 4


def test_cli_spill_here_restore_elsewhere(redis_server, tmp_path, capsys):
    """`kvtier spill` with one data dir, `kvtier restore --verify` with another, empty one: every
    block comes from the shared tier; `kvtier inspect` counts this fingerprint's entries."""
    import json

    from kvtier.cli import main
    yaml = tmp_path / "fleet.yaml"
    yaml.write_text(f"""
block_bytes: 128KiB
model: cli-fleet
tiers:
  - {{name: cpu, kind: cpu, capacity_blocks: 16}}
  - {{name: nvme, kind: nvme, path: "${{KVTIER_DATA}}", capacity_blocks: 64}}
  - {{name: shared, kind: redis, url: "{redis_server.url}"}}
policy: {{demotion: write_back}}
""")
    import os
    os.environ["KVTIER_DATA"] = str(tmp_path / "a")
    try:
        assert main(["spill", "--config", str(yaml), "--blocks", "100", "--seed", "7", "--json", "-q"]) == 0
        d = json.loads(capsys.readouterr().out)
        assert d["on_shared"] == 100 and d["nvme_resident"] == 64
        os.environ["KVTIER_DATA"] = str(tmp_path / "b")  # another machine: nothing on its disk
        assert main(["restore", "--config", str(yaml), "--verify", "--json", "-q"]) == 0
        d = json.loads(capsys.readouterr().out)
        assert (d["tier"], d["restored"], d["verified_blocks"], d["bad_served"]) == ("shared", 100, 100, 0)
        assert main(["inspect", "--config", str(yaml), "--json"]) == 0
        d = json.loads(capsys.readouterr().out)
        sh = next(t for t in d["tiers"] if t["kind"] == "shared")
        assert sh["resident_blocks"] == 100 and sh["server_memory"]["maxmemory_policy"] == "allkeys-lru"
        # a block the server lost: restore --verify fails and says so
        from kvtier.offline.blockgen import block_key
        from kvtier.core.config import load_config
        ns = Namespace(load_config(str(yaml), check_env=False).fingerprint())
        redis_server.client().delete(ns.name(block_key(7, 3)))
        assert main(["restore", "--config", str(yaml), "--verify", "--json", "-q"]) == 1
        d = json.loads(capsys.readouterr().out)["result"]
        assert d["restored"] == 99 and d["missing"] == 1 and "absent from the shared tier" in d["problem"]
    finally:
        os.environ.pop("KVTIER_DATA", None)



def test_cli_with_the_shared_server_down(tmp_path, capsys, monkeypatch, caplog):
    """No server on the port: `kvtier spill` still spills to NVMe (exit 0, a warning that the
    server got no manifest, on_shared null); restoring from the fleet's tier on a machine with
    nothing on disk is one error line naming the server (was an internal error)."""
    import json
    import socket

    from kvtier.cli import main
    with socket.socket() as sock:      # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    yaml = tmp_path / "fleet.yaml"
    yaml.write_text(f"""
block_bytes: 64KiB
model: cli-down
tiers:
  - {{name: cpu, kind: cpu, capacity_blocks: 8}}
  - {{name: nvme, kind: nvme, path: "${{KVTIER_DATA}}", capacity_blocks: 32}}
  - {{name: shared, kind: redis, url: "redis://127.0.0.1:{port}/0", timeout_s: 0.5}}
""")
    monkeypatch.setenv("KVTIER_DATA", str(tmp_path / "a"))
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        assert main(["spill", "--config", str(yaml), "--blocks", "20", "--json", "-q"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["nvme_resident"] == 20 and d["on_shared"] is None
    assert "no spill manifest written there" in caplog.text
    monkeypatch.setenv("KVTIER_DATA", str(tmp_path / "b"))
    assert main(["restore", "--config", str(yaml), "-q"]) == 1
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("kvtier: error:")]
    assert len(err) == 1 and "shared tier redis://127.0.0.1:" in err[0] and "EHOSTUNREACH" in err[0], err

def test_hit_ratio_leaves_out_blocks_gone_at_load():
    from kvtier.core.serving_stats import hit_ratios
    r = hit_ratios({"totals": {"hit_blocks.shared": 18, "gone_blocks.shared": 9, "hit_blocks.cpu": 2,
                               "miss_blocks": 1}, "time": 0})
    assert r["blocks_looked_up"] == 21 and r["hit_ratio_by_tier"]["shared"] == 9 / 21
    assert r["hit_ratio"] == 11 / 21
