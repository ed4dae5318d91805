"""A value of another Redis type (a list, a hash, a set, a stream) under a block's key, on a real
redis-server or Redis Cluster, is a bad value like a corrupt string: its GET answers WRONGTYPE for
that key alone, so the rest of the batch is served byte-exact, the planted key is a miss, counted
(`corrupt_blocks`, of which `wrong_type_blocks`), logged once, deleted on the server while it still
holds a non-string value, and remembered; the server is not reported unreachable."""

from __future__ import annotations

import errno
import logging
import sys
from pathlib import Path

import pytest
import torch

from kvtier.core.config import parse_config
from kvtier.core.stack import TierStack
from kvtier.tiers.shared_conn import Namespace, RedisSettings
from kvtier.tiers.shared_data import SharedData

BB = 64 << 10
SECRET = "fleet-secret"
KINDS = ["list", "hash", "set", "stream"]


def _cfg(url: str, cluster: bool = False):
    return parse_config({"block_bytes": BB, "model": "wrong-type-tests", "tiers": [
        {"name": "cpu", "kind": "cpu", "capacity_blocks": 16},
        {"name": "shared", "kind": "redis", "url": url, "cluster": cluster, "timeout_s": 5,
         "connect_timeout_s": 5, "secret": SECRET}]}, check_env=False)


def _keys(tag: str, n: int) -> list[bytes]:
    return [f"{tag}-{i:04d}".encode().ljust(16, b".") for i in range(n)]


def _blocks(n: int, seed: int = 5) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 255, (BB,), dtype=torch.uint8, generator=g) for _ in range(n)]


def plant(cl, name: bytes, kind: str) -> None:
    """A value of Redis type `kind` under `name` (in place of whatever was there)."""
    cl.delete(name)
    {"list": lambda: cl.rpush(name, b"a", b"b"), "hash": lambda: cl.hset(name, "f", "v"),
     "set": lambda: cl.sadd(name, b"m"), "stream": lambda: cl.xadd(name, {"f": "v"})}[kind]()
    assert cl.type(name) in (kind.encode(), kind)


def _not_down(counters: dict, plane: SharedData) -> None:
    assert not plane.breaker.down
    assert not [k for k in counters if k.startswith(("unreachable", "skipped_blocks", "lookup_failures"))], counters


# ---- the data plane: one batch, planted values between good ones ---------------------------------

@pytest.mark.parametrize("direct", [True, False], ids=["direct", "pipeline"])
@pytest.mark.parametrize("where", ["standalone", "cluster"])
def test_wrong_typed_values_in_a_batch_are_bad_values_the_rest_is_served(where, direct, request, caplog):
    server = request.getfixturevalue("redis_server" if where == "standalone" else "redis_cluster")
    cfg = _cfg(server.url, cluster=where == "cluster")
    keys, data = _keys(f"batch-{where}-{direct}", 8), _blocks(8)
    plane = SharedData(RedisSettings.of(cfg.tiers[1]), Namespace(cfg.fingerprint(), SECRET), BB)
    cl = server.client()
    try:
        plane.direct_reads = direct
        assert all(plane.write([], data, keys).wait().ok)
        bad_at = {1: "list", 3: "hash", 5: "set", 6: "stream"}
        for i, kind in bad_at.items():
            plant(cl, plane.ns.name(keys[i]), kind)
        out = [torch.zeros(BB, dtype=torch.uint8) for _ in keys]
        with caplog.at_level(logging.WARNING, logger="kvtier.shared"):
            r = plane.read([], out, keys).wait()
        assert r.ok == [i not in bad_at for i in range(8)]
        assert r.bad == [i in bad_at for i in range(8)]
        for i in range(8):   # the good blocks byte-exact, the planted ones' buffers untouched
            assert torch.equal(out[i], data[i] if i not in bad_at else torch.zeros(BB, dtype=torch.uint8))
        c = plane.counters
        assert c["corrupt_blocks"] == 4 and c["wrong_type_blocks"] == 4 and c["bad_deleted_blocks"] == 4
        assert "bad_delete_failed_blocks" not in c and "bad_rewritten_blocks" not in c
        _not_down(c, plane)
        for i in range(8):   # the planted keys deleted, the good ones stay
            assert cl.exists(plane.ns.name(keys[i])) == (0 if i in bad_at else 1)
        lines = [r.getMessage() for r in caplog.records]
        assert len([m for m in lines if "wrong type" in m]) == 1, lines
        assert not [m for m in lines if "unreachable" in m], lines
        r2 = plane.read([], out, keys).wait()   # read again: now plain misses, nothing fails
        assert r2.ok == r.ok and not any(r2.bad or [])
        assert plane.counters["corrupt_blocks"] == 4
        _not_down(plane.counters, plane)
    finally:
        plane.close()
        cl.close()


# ---- the connector's stack: lookups, marks, counters ---------------------------------------------

@pytest.mark.parametrize("direct", [True, False], ids=["direct", "pipeline"])
@pytest.mark.parametrize("where", ["standalone", "cluster"])
def test_wrong_typed_values_are_misses_deleted_and_never_a_server_down(where, direct, request, caplog):
    server = request.getfixturevalue("redis_server" if where == "standalone" else "redis_cluster")
    cfg = _cfg(server.url, cluster=where == "cluster")
    keys, data = _keys(f"stack-{where}-{direct}", 8), _blocks(8, 7)
    with TierStack.from_config(cfg) as st:
        assert st.put(keys, data) == 8
    ns = Namespace(cfg.fingerprint(), SECRET)
    cl = server.client()
    for i, kind in zip(range(4, 8), KINDS):   # blocks 4-7: a list, a hash, a set, a stream
        plant(cl, ns.name(keys[i]), kind)
    with TierStack.from_config(cfg) as st:    # a fresh instance: nothing in its CPU tier
        shared = st.tiers[1]
        shared.conn.direct_reads = direct
        out = [torch.zeros(BB, dtype=torch.uint8) for _ in keys]
        with caplog.at_level(logging.WARNING, logger="kvtier.shared"):
            assert st.get(keys, out) == 4
        assert all(torch.equal(a, b) for a, b in zip(out[:4], data[:4]))
        assert all(not cl.exists(ns.name(k)) for k in keys[4:])          # deleted on the server
        assert shared.stats()["bad_marked_blocks"] == 4 and not shared.stats()["server_down"]
        asked = []
        real = shared.conn.exists
        shared.conn.exists = lambda ks, ranks=1: asked.append(list(ks)) or real(ks, ranks)
        for _ in range(3):                                                # remembered: never asked again
            assert st.lookup(keys) == 4
            assert st.get(keys, out) == 4
        assert not [k for ks in asked for k in ks if k in keys[4:]], asked
        tot = st.ctrl.totals
        assert tot["corrupt_blocks.shared"] == 4 and tot["wrong_type_blocks.shared"] == 4
        assert tot["bad_blocks.shared"] == 4 and tot["bad_deleted_blocks.shared"] == 4
        assert not [k for k in tot if k.startswith(("unreachable", "skipped_blocks", "lookup_failures"))], tot
        lines = [r.getMessage() for r in caplog.records]
        assert len([m for m in lines if "wrong type" in m]) == 1 and not [m for m in lines if "unreachable" in m]
        assert st.put(keys[4:], data[4:]) == 4                            # written again: served again
        assert st.lookup(keys) == 8
    cl.close()


def test_a_good_value_written_before_the_delete_stays(redis_server, monkeypatch):
    """The delete is conditional: a key is deleted only while its TYPE is still not string, so a
    good value another instance SET between the read and the delete stays (counted as rewritten)."""
    cfg = _cfg(redis_server.url)
    keys, data = _keys("rewritten", 2), _blocks(2, 9)
    plane = SharedData(RedisSettings.of(cfg.tiers[1]), Namespace(cfg.fingerprint(), SECRET), BB)
    cl = redis_server.client()
    try:
        assert all(plane.write([], data, keys).wait().ok)
        name = plane.ns.name(keys[1])
        good = cl.get(name)
        plant(cl, name, "hash")
        drop = SharedData.drop_bad

        def rewrite_first(self, items):
            cl.set(name, good)
            return drop(self, items)

        monkeypatch.setattr(SharedData, "drop_bad", rewrite_first)
        out = [torch.zeros(BB, dtype=torch.uint8) for _ in keys]
        assert plane.read([], out, keys).wait().ok == [True, False]
        assert cl.get(name) == good
        c = plane.counters
        assert c["bad_rewritten_blocks"] == 1 and "bad_deleted_blocks" not in c and "bad_delete_failed_blocks" not in c
        monkeypatch.setattr(SharedData, "drop_bad", drop)
        assert plane.read([], out, keys).wait().ok == [True, True] and torch.equal(out[1], data[1])
    finally:
        plane.close()
        cl.close()


def test_a_corrupt_string_replaced_by_a_list_before_its_delete_is_left(redis_server, monkeypatch):
    """The compare-and-delete of a corrupt string meets a list there now: no script error (not a
    failed delete), left in place (rewritten since); the next read finds it wrong-typed and drops it."""
    cfg = _cfg(redis_server.url)
    keys, data = _keys("relisted", 2), _blocks(2, 11)
    plane = SharedData(RedisSettings.of(cfg.tiers[1]), Namespace(cfg.fingerprint(), SECRET), BB)
    cl = redis_server.client()
    try:
        assert all(plane.write([], data, keys).wait().ok)
        name = plane.ns.name(keys[1])
        cl.set(name, cl.get(name)[:-1])   # truncated by one byte
        drop = SharedData.drop_bad

        def relist_first(self, items):
            plant(cl, name, "list")
            return drop(self, items)

        monkeypatch.setattr(SharedData, "drop_bad", relist_first)
        out = [torch.zeros(BB, dtype=torch.uint8) for _ in keys]
        assert plane.read([], out, keys).wait().ok == [True, False]
        assert cl.type(name) in (b"list", "list")
        c = plane.counters
        assert c["bad_rewritten_blocks"] == 1 and "bad_delete_failed_blocks" not in c
        monkeypatch.setattr(SharedData, "drop_bad", drop)
        assert plane.read([], out, keys).wait().ok == [True, False]
        assert not cl.exists(name) and plane.counters["bad_deleted_blocks"] == 1
        _not_down(plane.counters, plane)
    finally:
        plane.close()
        cl.close()


# ---- kvtier.vllm: the same tier under vLLM's native tiering API ----------------------------------

def test_native_tier_wrong_typed_values_are_load_misses_not_a_server_down(tmp_path, redis_server):
    pytest.importorskip("vllm.v1.kv_offload.tiering.spec")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from native_util import Deployment, model_dir, offload_key, payload, shared

    dep = Deployment(model_dir(tmp_path, 31), [shared(redis_server.url, namespace="wrongtype")])
    cl = redis_server.client()
    try:
        keys = [offload_key(i, b"wrongtype") for i in range(8)]
        datas = [payload(i, dep.chunk_bytes, b"wrongtype") for i in range(8)]
        dep.store(keys[:4], datas[:4])
        dep.store(keys[4:], datas[4:])                       # keys[:4] only on the server now
        tier = dep.tiers[0]
        names = [tier.tier.ns.name(k) for k in keys]
        for i, kind in zip((1, 2, 3), ("list", "hash", "set")):
            plant(cl, names[i], kind)
        assert dep.load(keys[:4]) == datas[:1]               # the good chunk served, the prefix ends after it
        c = tier.all_counters()
        assert c["server.corrupt_blocks"] == 3 and c["server.wrong_type_blocks"] == 3
        assert c["server.bad_deleted_blocks"] == 3 and c["load_misses"] == 3
        assert not [k for k in c if "unreachable" in k or "lookup_failures" in k or "server_down" in k], c
        assert not tier.tier.conn.breaker.down
        assert [cl.exists(n) for n in names[:4]] == [1, 0, 0, 0]
        asked = []
        real = tier.tier.conn.exists
        tier.tier.conn.exists = lambda ks, ranks=1: asked.append(list(ks)) or real(ks, ranks)
        assert dep.load(keys[:4]) == datas[:1]               # remembered: misses, not asked again
        assert not [k for ks in asked for k in ks if k in keys[1:4]], asked
        assert tier.all_counters()["server.corrupt_blocks"] == 3
    finally:
        dep.close()
        cl.close()


# ---- the spill manifest kept on the server (kvtier spill / restore) ------------------------------

def test_a_wrong_typed_spill_manifest_is_damaged_not_a_server_down(redis_server):
    from kvtier.cli.manifest import get_shared_manifest, put_shared_manifest
    from kvtier.tiers.shared import SharedTier

    t = SharedTier("shared", RedisSettings(url=redis_server.url, timeout_s=5, connect_timeout_s=5),
                  {"model": "wrong-type-manifest"}, BB)
    cl = redis_server.client()
    try:
        plant(cl, t.ns.prefix + b"manifest:7", "hash")
        for seed in (7, None):   # by seed, and the newest of those found by SCAN
            with pytest.raises(OSError) as e:
                get_shared_manifest(t, seed)
            assert e.value.errno == errno.EINVAL and "another Redis type" in str(e.value)
            assert "\n" not in str(e.value)
        assert not t.conn.breaker.down and "unreachable" not in t.conn.counters
        put_shared_manifest(t, 7, 0, [])   # written again (SET replaces any type): a manifest again
        assert get_shared_manifest(t, 7)["seed"] == 7
    finally:
        t.close()
        cl.close()


# ---- the connector: scheduler adapter and worker, without vLLM -----------------------------------

@pytest.mark.parametrize("async_loads", [False, True])
def test_connector_wrong_typed_values_are_load_errors_not_a_server_down(redis_server, async_loads):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_connector_shared import BS, Req, _ask, _instance, _step

    tag = f"wrongtype-{async_loads}"
    hashes = [f"{tag}-{i}".encode().ljust(32, b"_") for i in range(4)]
    a, wa, ca, fp = _instance(redis_server.url, tag, async_loads)
    b, wb, cb, _ = _instance(redis_server.url, tag, async_loads)
    cl = redis_server.client()
    try:
        req = Req("ra", hashes, 4 * BS + 1)
        _ask(a, req)
        a.on_alloc(req, [list(range(5))], 0)
        _step(a, wa, [("ra", req.num_tokens, list(range(5)))])
        for t in cb.values():
            t.zero_()
        rb = Req("rb", hashes, 4 * BS + 1)
        assert _ask(b, rb) == 4 * BS
        names = [Namespace(fp).name(h + (0).to_bytes(4, "big")) for h in hashes]
        plant(cl, names[2], "hash")                          # found by the lookup, wrong-typed at load
        plant(cl, names[3], "list")
        b.on_alloc(rb, [[20, 21, 22, 23, 24]], 4 * BS)
        _step(b, wb, [])
        assert wb.take_load_errors() == {22, 23}             # vLLM recomputes from block 2
        for ta, tb in zip(ca.values(), cb.values()):         # blocks 0-1 loaded byte-exact
            assert torch.equal(tb[20], ta[0]) and torch.equal(tb[21], ta[1])
        assert [cl.exists(n) for n in names] == [1, 1, 0, 0]  # the planted values deleted
        assert b.ctrl.totals["bad_blocks.shared"] == 2
        assert wb.totals["corrupt_blocks.shared"] == 2 and wb.totals["wrong_type_blocks.shared"] == 2
        for tot in (b.ctrl.totals, wb.totals):
            assert not [k for k in tot if k.startswith(("unreachable", "skipped_blocks", "lookup_failures"))], tot
        assert _ask(b, Req("rc", hashes, 4 * BS + 1)) == 2 * BS   # remembered: the lookup stops there
    finally:
        for x in (a, b, wa, wb):
            x.close()
        cl.close()
