"""`kvtier bench` for the shared tier, tiny, against a real redis-server: the report's structure
(rows per size, ratios > 0, keys deleted), the zero-copy packer's values byte-identical to `seal`.
Never asserts speed."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

from kvtier.cli.bench_shared import bench_shared
from kvtier.tiers.shared_conn import Namespace, RedisSettings, connect
from kvtier.tiers.shared_data import SharedData

ROOT = Path(__file__).resolve().parent.parent


def test_bench_shared_rows_and_cleanup(redis_server):
    s = RedisSettings(url=redis_server.url, timeout_s=10)
    c = connect(s, plain=True)
    before = c.dbsize()
    rows = []
    for bb in (64 << 10, 256 << 10):
        rows += bench_shared(s, bb, 1 << 20, repeat=2, threads=2)
    assert [r["what"] for r in rows] == ["shared put", "shared get"] * 2
    assert [r["block_bytes"] for r in rows] == [64 << 10] * 2 + [256 << 10] * 2
    for r in rows:
        assert r["ours_gbps"] > 0 and r["limit_gbps"] > 0 and r["ratio"] > 0
        assert r["blocks"] == (1 << 20) // r["block_bytes"]
        assert r["keys_left"] == 0
        assert len(r["raw_s"]["ours"]) == len(r["raw_s"]["limit"]) == 2
    assert c.dbsize() == before                       # every key it wrote is gone
    assert not list(c.scan_iter(match=b"kvt:bench-raw:*"))
    c.close()


def test_bench_cli_redis_flag(redis_server):
    out = subprocess.run([sys.executable, "-m", "kvtier", "bench", "--skip-nvme", "--skip-cpu", "--json",
                          "--redis", redis_server.url, "--total", "512KiB", "--repeat", "1",
                          "--sizes", "128KiB"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout.strip().splitlines()[-1])
    assert [r["what"] for r in d["rows"]] == ["shared put", "shared put encrypted", "shared get",
                                              "shared get encrypted"]
    assert all(r["ratio"] > 0 and r["keys_left"] == 0 for r in d["rows"])
    assert any("shared tier" in n for n in d["notes"])


def test_bench_skips_redis_without_one():
    from kvtier.cli.bench_shared import shared_settings
    assert shared_settings(argparse.Namespace(config=None, redis=None, skip_redis=False)) is None


def _same_bytes(url: str, cluster: bool) -> None:
    s = RedisSettings(url=url, cluster=cluster, timeout_s=10)
    d = SharedData(s, Namespace({"t": "zero-copy", "cluster": cluster}), 64 << 10, threads=2)
    assert d.client.kvtier_zero_copy
    keys = [bytes([i]) * 16 for i in range(6)]
    src = torch.randint(0, 256, (6, 64 << 10), dtype=torch.uint8)
    assert d.write((), list(src.unbind(0)), keys).wait().all_ok
    raw = connect(s, plain=True)
    for k, t in zip(keys, src.unbind(0)):
        assert raw.get(d.ns.name(k)) == bytes(d.seal(k, t)) == d.seal_parts(k, t).tobytes()
    dst = torch.zeros_like(src)
    assert d.read((), list(dst.unbind(0)), keys).wait().all_ok and torch.equal(src, dst)
    for k in keys:
        raw.delete(d.ns.name(k))
    raw.close()
    d.close()


def test_zero_copy_values_identical_standalone(redis_server):
    _same_bytes(redis_server.url, False)


def test_zero_copy_values_identical_cluster(redis_cluster):
    _same_bytes(redis_cluster.url, True)


def _direct_only(d: SharedData) -> None:
    def no_pipeline(*a):
        raise AssertionError("read through redis-py's pipeline, not directly")
    d._get_pipeline = no_pipeline


def test_direct_reads_standalone_and_cluster(redis_server, redis_cluster):
    for url, cluster in ((redis_server.url, False), (redis_cluster.url, True)):
        s = RedisSettings(url=url, cluster=cluster, timeout_s=10)
        d = SharedData(s, Namespace({"t": "direct", "cluster": cluster}), 32 << 10, threads=2)
        keys = [b"direct-%02d" % i for i in range(24)]
        src = torch.randint(0, 256, (24, 32 << 10), dtype=torch.uint8)
        assert d.write((), list(src.unbind(0)), keys).wait().all_ok
        _direct_only(d)
        dst = torch.zeros_like(src)
        r = d.read((), list(dst.unbind(0)) + [torch.zeros(32 << 10, dtype=torch.uint8)], keys + [b"absent"]).wait()
        assert r.ok == [True] * 24 + [False] and torch.equal(src, dst)
        assert d.counters["missing_blocks"] == 1 and d.counters["bytes_read"] == 24 * (32 << 10)
        raw = connect(s, plain=True)
        for k in keys:
            raw.delete(d.ns.name(k))
        raw.close()
        d.close()


def test_cluster_redirect_falls_back_to_the_pipeline(redis_cluster):
    """A stale slot table (the key's slot pointed at another node): that node answers MOVED, the
    batch is read through redis-py's pipeline (which follows it); no breaker trip."""
    s = RedisSettings(url=redis_cluster.url, cluster=True, timeout_s=10)
    d = SharedData(s, Namespace({"t": "moved"}), 16 << 10, threads=1)
    key = b"moved-key"
    src = torch.randint(0, 256, (16 << 10,), dtype=torch.uint8)
    assert d.write((), [src], [key]).wait().all_ok
    c = d.client
    slot = c.keyslot(d.ns.name(key))
    owner = c.nodes_manager.get_node_from_slot(slot)
    other = next(n for n in c.nodes_manager.nodes_cache.values() if n.name != owner.name and n.server_type == "primary")
    c.nodes_manager.slots_cache[slot] = [other]
    used = []
    real = d._get_pipeline
    d._get_pipeline = lambda ks, ds: used.append(len(ks)) or real(ks, ds)
    dst = torch.zeros_like(src)
    r = d.read((), [dst], [key]).wait()
    assert r.ok == [True] and torch.equal(src, dst) and used == [1]
    assert not d.breaker.down and "unreachable" not in d.counters
    connect(s, plain=True).delete(d.ns.name(key))
    d.close()
