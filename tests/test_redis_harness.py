"""The real-server harness (tests/redis_util.py, conftest fixtures) works: values round-trip byte-exact on
a standalone server, across a 3-node cluster, over TLS; auth and ACLs are enforced; kill/restart behave."""

from __future__ import annotations

import os
import sys
import uuid

import pytest
import redis
import redis.cluster
from redis.backoff import NoBackoff
from redis.retry import Retry

sys.path.insert(0, os.path.dirname(__file__))
import redis_util as R  # noqa: E402

MIB = 1 << 20


def _once(s, **kw) -> redis.Redis:
    """A client without retries: redis-py 8 retries ConnectionError (AuthenticationError included)
    10 times with backoff by default, seconds per refused login."""
    return redis.Redis(host=s.host, port=s.port, retry=Retry(NoBackoff(), 0), **kw)


def _key(tag: str = "") -> str:
    return f"harness:{tag}{uuid.uuid4().hex}"


def test_standalone_1mib_roundtrip(redis_server):
    c = redis_server.client()
    v = os.urandom(MIB)
    k = _key()
    assert c.set(k, v)
    assert c.get(k) == v
    # bytearray / memoryview values are accepted and stored byte-exact too
    assert c.set(k, memoryview(bytearray(v))[1:])
    assert c.get(k) == v[1:]
    assert c.config_get("maxmemory-policy") == {"maxmemory-policy": "allkeys-lru"}
    assert int(c.config_get("maxmemory")["maxmemory"]) == 256 * MIB


def test_cluster_keys_on_all_nodes(redis_cluster):
    c = redis.cluster.RedisCluster.from_url(redis_cluster.url)
    assert {(n.host, n.port) for n in c.get_primaries()} == {(n.host, n.port) for n in redis_cluster.nodes}
    big = os.urandom(MIB)
    keys = [_key(f"{i}:") for i in range(60)]
    vals = {k: big if i == 0 else os.urandom(4096 + i) for i, k in enumerate(keys)}
    # one pipeline, keys on different slots/nodes: SET, then GET and EXISTS, results in command order
    p = c.pipeline()
    for k in keys:
        p.set(k, vals[k])
    assert p.execute() == [True] * len(keys)
    p = c.pipeline()
    for k in keys:
        p.get(k)
        p.exists(k)
    assert p.execute() == [x for k in keys for x in (vals[k], 1)]
    # the server's CLUSTER KEYSLOT agrees with the client, and each node holds exactly its own keys
    by_port: dict[int, list[str]] = {}
    for k in keys:
        slot = c.cluster_keyslot(k)
        assert slot == c.keyslot(k)
        by_port.setdefault(c.get_node_from_key(k).port, []).append(k)
    assert set(by_port) == {n.port for n in redis_cluster.nodes}, "keys did not land on all 3 nodes"
    for n in redis_cluster.nodes:
        direct = n.client()
        mine = by_port[n.port]
        dp = direct.pipeline(transaction=False)  # multi-key EXISTS would be CROSSSLOT even on one node
        for k in mine:
            dp.exists(k)
        assert dp.execute() == [1] * len(mine)
        assert direct.get(mine[0]) == vals[mine[0]]
        other = next(k for p_, ks in by_port.items() if p_ != n.port for k in ks)
        with pytest.raises(redis.exceptions.MovedError):  # a plain client is not redirected
            direct.get(other)
        direct.close()
    assert c.delete(*keys) == len(keys)  # RedisCluster splits multi-key DEL by slot
    c.close()


def test_tls_with_ca(redis_factory):
    s = redis_factory(tls=True)
    assert s.url.startswith("rediss://") and s.ca_path and os.path.isfile(s.ca_path)
    c = redis.Redis.from_url(s.url, ssl_ca_certs=s.ca_path)
    v = os.urandom(MIB)
    assert c.set("k", v) and c.get("k") == v
    assert c.config_get("port") == {"port": "0"}  # TLS only: no plaintext port
    c.close()
    # the certificate is really verified: without the CA the handshake fails
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(s.url, socket_timeout=5).ping()


def test_password_auth(redis_factory):
    s = redis_factory(password="s3cret")
    assert s.url.startswith("redis://:s3cret@")
    assert s.client().ping()
    with pytest.raises(redis.AuthenticationError):
        _once(s, password="wrong").ping()
    with pytest.raises(redis.AuthenticationError):
        _once(s).ping()


def test_acl_user_and_default_refused(redis_factory):
    s = redis_factory(acl_user=("alice", "alicepw"))
    c = s.client()
    assert c.acl_whoami() in ("alice", b"alice")  # redis-py 8 decodes this reply
    assert c.set("k", b"v") and c.get("k") == b"v"
    with pytest.raises(redis.AuthenticationError):
        _once(s).ping()
    with pytest.raises(redis.AuthenticationError):
        _once(s, username="alice", password="wrong").ping()
    with pytest.raises(redis.AuthenticationError):  # the default user is off
        _once(s, username="default", password="alicepw").ping()


def test_kill_then_restart(redis_factory):
    s = redis_factory()
    c = s.client(socket_timeout=5, socket_connect_timeout=5)
    assert c.set("k", b"v")
    port, pid = s.port, s.pid
    s.kill()
    assert not s.running
    with pytest.raises(redis.ConnectionError):
        c.get("k")
    s.restart()
    assert (s.port, s.running) == (port, True) and s.pid != pid
    assert c.get("k") is None  # save "": nothing survives
    assert c.set("k", b"w") and c.get("k") == b"w"
    c.close()


def test_maxmemory_evicts(redis_factory):
    s = redis_factory(maxmemory="4mb")
    c = s.client()
    keys = [f"k{i}" for i in range(40)]
    for k in keys:
        assert c.set(k, os.urandom(256 * 1024))  # allkeys-lru: writes past the limit evict, never OOM
    assert c.info("stats")["evicted_keys"] > 0
    assert c.exists(*keys) < len(keys)


def test_missing_binary_message(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(R.HarnessError, match=r"^redis-server not found: run scripts/setup test"):
        R.server_binary()
