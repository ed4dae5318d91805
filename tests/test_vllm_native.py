"""kvtier's NVMe and shared tiers as secondary tiers of vLLM's native offloading, driven through
vLLM's real `TieringOffloadingManager` built by a real `TieringOffloadingSpec` that loads them by
`module_path` (tests/native_util.py), with real files, LMDB and a real `redis-server`."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm.v1.kv_offload.tiering.spec")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from native_util import Deployment, model_dir, nvme, offload_key, payload, shared  # noqa: E402

from kvtier.core.errors import ConfigError  # noqa: E402
from kvtier.tiers.nvme_dir import DATA_FILE  # noqa: E402
from kvtier.tiers.nvme_block import slot_stride  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult, ReqContext  # noqa: E402


def chunks(n, nbytes, salt=b""):
    return [offload_key(i, salt) for i in range(n)], [payload(i, nbytes, salt) for i in range(n)]


@pytest.fixture
def dep_factory():
    made = []

    def make(*a, **kw):
        d = Deployment(*a, **kw)
        made.append(d)
        return d
    yield make
    for d in made:
        if d.rows is not None:
            d.close()


def test_store_cascades_to_nvme_and_redis_and_loads_back_byte_exact(tmp_path, redis_server, dep_factory):
    dep = dep_factory(model_dir(tmp_path, 1), [nvme(tmp_path / "nv"), shared(redis_server.url, namespace="t1")])
    nv, sh = dep.tiers
    keys, datas = chunks(8, dep.chunk_bytes, b"cascade")
    assert dep.store(keys[:4], datas[:4]) == []
    evicted = dep.store(keys[4:], datas[4:])
    assert sorted(evicted) == sorted(keys[:4])                             # the primary (4 chunks) evicted the first four
    assert nv.tier.num_resident == 8                         # every chunk cascaded to NVMe ...
    assert sh.tier.scan_count() == 8                         # ... and to the server
    assert dep.load(keys[:4]) == datas[:4]                   # found below the primary, byte-exact
    assert nv.counters.get("corrupt_chunks", 0) == 0


def test_shared_tier_alone_serves_after_primary_eviction(tmp_path, redis_server, dep_factory):
    dep = dep_factory(model_dir(tmp_path, 2), [shared(redis_server.url, namespace="alone")])
    keys, datas = chunks(8, dep.chunk_bytes, b"alone")
    dep.store(keys[:4], datas[:4])
    dep.store(keys[4:], datas[4:])
    # another instance of the same model (a fresh scheduler: nothing known locally) asks the server
    other = dep_factory(model_dir(tmp_path, 2), [shared(redis_server.url, namespace="alone")])
    assert other.load(keys[:4]) == datas[:4]


def test_restart_reopens_the_directory_and_serves_it(tmp_path, dep_factory):
    model = model_dir(tmp_path, 3)
    dep = dep_factory(model, [nvme(tmp_path / "nv")])
    keys, datas = chunks(4, dep.chunk_bytes, b"restart")
    dep.store(keys, datas)
    with pytest.raises(OSError, match="in use|already open"):             # one writer per directory: the lock
        Deployment(model, [nvme(tmp_path / "nv")])
    dep.close()
    for name in os.listdir(tmp_path / "nv"):                 # private files, as the connector's
        assert os.stat(tmp_path / "nv" / name).st_mode & 0o077 == 0, name
    again = dep_factory(model, [nvme(tmp_path / "nv")])
    assert again.tiers[0].tier.num_resident == 4
    assert again.load(keys) == datas
    # another model's deployment on the same directory refuses it (no foreign chunk is served)
    again.close()
    with pytest.raises(Exception, match="fingerprint"):
        Deployment(model_dir(tmp_path, 4), [nvme(tmp_path / "nv")])


def test_flipped_byte_is_a_miss_and_a_counter(tmp_path, dep_factory, caplog):
    model = model_dir(tmp_path, 5)
    dep = dep_factory(model, [nvme(tmp_path / "nv")])
    keys, datas = chunks(8, dep.chunk_bytes, b"flip")
    dep.store(keys[:4], datas[:4])
    dep.store(keys[4:], datas[4:])                           # keys[:4] now only on NVMe
    tier = dep.tiers[0]
    slot = tier.tier.find(keys[1])
    with open(tmp_path / "nv" / DATA_FILE, "r+b") as f:
        off = slot * slot_stride(dep.chunk_bytes) + 4096 + 777
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x01]))
    with caplog.at_level(logging.ERROR, logger="kvtier.vllm"):
        got = dep.load(keys[:4])
    assert got == datas[:1]                                  # the prefix ends at the bad chunk
    assert tier.counters["corrupt_chunks"] == 1
    assert "failed verification" in caplog.text
    assert tier.tier.find(keys[1]) is None                   # quarantined: the next lookup misses
    assert tier.lookup(keys[1], ReqContext("x")) is LookupResult.MISS
    stats = dep.manager.get_stats()                          # exported through vLLM's stats
    defs = type(dep.spec).build_metric_definitions(dict(dep.cfg.extra_config))   # and declared to it
    assert defs["vllm:kv_offload_kvtier_events"].labelnames == ("tier", "event")
    assert stats.data["data"]["vllm:kv_offload_kvtier_events"][("KvtierNvmeTier", "corrupt_chunks")] == 1
    assert dep.load(keys[2:4]) == datas[2:4]                 # the rest is still served


def test_lookup_retries_while_a_store_is_in_flight(tmp_path, dep_factory):
    dep = dep_factory(model_dir(tmp_path, 6), [nvme(tmp_path / "nv")])
    tier = dep.tiers[0]
    keys, datas = chunks(2, dep.chunk_bytes, b"retry")
    ctx = ReqContext("r")
    dep.manager.on_new_request(ctx)
    out = dep.manager.prepare_store(keys, ctx)
    dep.manager.complete_store(out.keys_to_store, ctx)      # cascade submitted, not yet committed
    assert tier.lookup(keys[0], ctx) is LookupResult.RETRY
    assert tier.has_pending_work()
    dep.manager.on_request_finished(ctx)
    dep.settle()
    assert tier.lookup(keys[0], ctx) is LookupResult.HIT


def test_redis_killed_mid_run_is_a_miss_never_a_hang(tmp_path, redis_factory, dep_factory):
    server = redis_factory()
    dep = dep_factory(model_dir(tmp_path, 7), [shared(server.url, timeout_s=0.3, connect_timeout_s=0.3)])
    keys, datas = chunks(8, dep.chunk_bytes, b"kill")
    dep.store(keys[:4], datas[:4])
    dep.store(keys[4:], datas[4:])                           # keys[:4] only on the server now
    server.kill()
    assert dep.load(keys[:4]) == []                          # bounded: Deployment.lookup asserts a deadline
    n, _ = dep.lookup([offload_key(99, b"kill")])
    assert n == 0
    c = dep.tiers[0].all_counters()
    assert c["load_misses"] == 4                             # the four known chunks: failed loads, recomputed
    assert c["server.unreachable"] >= 1 and c["lookups_server_down"] >= 1   # the breaker: misses at once
    dep.store(*chunks(2, dep.chunk_bytes, b"after"))         # stores fail quietly: counted, no exception
    assert dep.tiers[0].all_counters()["store_errors"] == 2


def test_another_deployment_never_gets_the_first_ones_chunks(tmp_path, redis_server, dep_factory):
    a = dep_factory(model_dir(tmp_path, 8), [shared(redis_server.url)])
    keys, datas = chunks(4, a.chunk_bytes, b"fleet")
    a.store(keys, datas)
    other_model = dep_factory(model_dir(tmp_path, 9), [shared(redis_server.url)])
    assert other_model.load(keys) == []
    same_model = dep_factory(model_dir(tmp_path, 8), [shared(redis_server.url)])   # the control
    assert same_model.load(keys) == datas
    other_ns = dep_factory(model_dir(tmp_path, 8), [shared(redis_server.url, namespace="blue")])
    assert other_ns.load(keys) == []


@pytest.mark.parametrize("tier,match", [
    ({"pathx": "/tmp"}, r"secondary tier KvtierNvmeTier: pathx: unknown key"),
    ({"io": "fast"}, r"secondary tier KvtierNvmeTier: io: "),
    ({"capacity_blocks": 0}, r"secondary tier KvtierNvmeTier: capacity_blocks: must be between"),
    ({"eviction": "mru"}, r"secondary tier KvtierNvmeTier: eviction: unknown policy 'mru'; known: "),
    ({"capacity": "1GiB"}, r"secondary tier KvtierNvmeTier: tier 'nvme': give capacity or capacity_blocks, not both"),
])
def test_bad_nvme_options_are_one_line_naming_the_key(tmp_path, tier, match):
    cfg = {**nvme(tmp_path / "nv"), **tier}
    with pytest.raises(ConfigError, match=match) as e:
        Deployment(model_dir(tmp_path, 10), [cfg])
    assert "\n" not in str(e.value)


def test_bad_shared_options_are_one_line_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"secondary tier KvtierSharedTier: url: must be a redis") as e:
        Deployment(model_dir(tmp_path, 11), [shared("http://x")])
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"KvtierNvmeTier: path: missing"):
        Deployment(model_dir(tmp_path, 11), [{"type": "KvtierNvmeTier", "module_path": "kvtier.vllm"}])


def test_a_corrupt_value_on_the_server_is_a_miss_and_a_counter(tmp_path, redis_server, dep_factory):
    dep = dep_factory(model_dir(tmp_path, 12), [shared(redis_server.url, namespace="corrupt")])
    keys, datas = chunks(8, dep.chunk_bytes, b"corrupt")
    dep.store(keys[:4], datas[:4])
    dep.store(keys[4:], datas[4:])                           # keys[:4] only on the server now
    tier = dep.tiers[0]
    cl = redis_server.client()
    name = tier.tier.ns.name(keys[0])
    n = cl.strlen(name)
    last = cl.getrange(name, n - 1, n - 1)
    cl.setrange(name, n - 1, bytes([last[0] ^ 0x01]))        # one payload byte flipped
    assert dep.load(keys[:4]) == []                          # the prefix ends at the bad chunk
    c = tier.all_counters()
    assert c["load_misses"] == 1 and c["server.corrupt_blocks"] == 1
    assert cl.exists(name) == 0                              # deleted on the server: nobody reads it again
    assert cl.exists(tier.tier.ns.name(keys[1])) == 1
    assert dep.load(keys[1:4]) == datas[1:4]


def test_a_requests_lookups_take_one_round_trip_to_the_server(tmp_path, redis_server, dep_factory):
    a = dep_factory(model_dir(tmp_path, 13), [shared(redis_server.url, namespace="rt")], cpu_chunks=8)
    keys, datas = chunks(8, a.chunk_bytes, b"roundtrip")
    a.store(keys, datas)
    b = dep_factory(model_dir(tmp_path, 13), [shared(redis_server.url, namespace="rt")], cpu_chunks=8)
    conn = b.tiers[0].tier.conn
    asked = []
    real = conn.exists
    conn.exists = lambda ks, ranks=1: asked.append(len(ks)) or real(ks, ranks)   # a spy on the real client
    more = keys + [offload_key(100 + i, b"roundtrip") for i in range(4)]          # 8 stored, then 4 not
    assert b.load(more) == datas
    assert asked == [12]                     # the step's 12 unknown keys in one pipelined EXISTS


def test_a_full_nvme_tier_evicts_by_its_policy(tmp_path, dep_factory):
    dep = dep_factory(model_dir(tmp_path, 14), [nvme(tmp_path / "nv", capacity_blocks=4, eviction="lru")])
    keys, datas = chunks(8, dep.chunk_bytes, b"full")
    dep.store(keys[:4], datas[:4])
    dep.store(keys[4:], datas[4:])
    tier = dep.tiers[0]
    assert tier.tier.num_resident == 4 and tier.counters["evicted"] == 4
    assert [tier.tier.find(k) is not None for k in keys] == [False] * 4 + [True] * 4   # the oldest left
    assert dep.load(keys[:2]) == []                          # gone from the primary and from NVMe


CHILD = """
import sys
sys.path.insert(0, {tests!r})
from native_util import Deployment, nvme, offload_key, payload
dep = Deployment({model!r}, [nvme({path!r})], cpu_chunks=8, engine_id="kvtier-kill-" + str(__import__("os").getpid()))
for b in range(10**6):
    keys = [offload_key(i, b"k%d" % b) for i in range(4)]
    dep.store(keys, [payload(i, dep.chunk_bytes, b"k%d" % b) for i in range(4)])
    print(b, flush=True)
"""


def test_kill_9_while_storing_then_a_restart_serves_every_reported_chunk_byte_exact(tmp_path, dep_factory):
    import signal
    import subprocess
    model, path = model_dir(tmp_path, 15), str(tmp_path / "nv")
    src = CHILD.format(tests=str(Path(__file__).resolve().parent), model=model, path=path)
    p = subprocess.Popen([sys.executable, "-c", src], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        done = -1
        while done < 5:
            line = p.stdout.readline()
            assert line, "the storing process died"
            done = int(line)
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        shm = f"/dev/shm/vllm_offload_kvtier-kill-{p.pid}.mmap"
        if os.path.exists(shm):
            os.unlink(shm)
    dep = dep_factory(model, [nvme(path)], cpu_chunks=8)     # the lock died with the process
    for b in range(done + 1):
        keys, datas = chunks(4, dep.chunk_bytes, b"k%d" % b)
        assert dep.load(keys) == datas, f"request {b}"
    assert dep.tiers[0].counters.get("corrupt_chunks", 0) == 0


def test_reset_cache_drains_the_tier_and_keeps_its_chunks(tmp_path, redis_server, dep_factory):
    """vLLM's reset_cache (sleep, weight update): drain_jobs, then every job's result is in."""
    dep = dep_factory(model_dir(tmp_path, 16), [nvme(tmp_path / "nv"), shared(redis_server.url, namespace="reset")])
    keys, datas = chunks(4, dep.chunk_bytes, b"reset")
    ctx = ReqContext("r")
    dep.manager.on_new_request(ctx)
    out = dep.manager.prepare_store(keys, ctx)
    by_key = dict(zip(keys, datas))
    for k, c in zip(out.keys_to_store, out.store_spec.chunk_ids):
        dep.rows[int(c)].copy_(torch.frombuffer(bytearray(by_key[k]), dtype=torch.uint8))
    dep.manager.complete_store(out.keys_to_store, ctx)      # cascades in flight
    dep.manager.on_request_finished(ctx)
    dep.manager.reset_cache()                                # asserts no job is left unreported
    assert not dep.manager.has_pending_work()
    assert dep.tiers[0].tier.num_resident == 4
    assert dep.load(keys) == datas                           # the primary is empty: from NVMe


@pytest.mark.parametrize("writer_tp,reader_tp", [(2, 1), (1, 2)])
def test_canonical_layout_chunks_are_parallel_agnostic_topology(tmp_path, redis_server, dep_factory, writer_tp,
                                                               reader_tp):
    """Under vLLM's canonical_layout (certified parallel-agnostic), a chunk written by a deployment of
    one TP size is served to another of the same model, through NVMe and through the server, as
    vLLM's fs tier does; without it, or under another layout, the chunks stay bound to the topology."""
    model = model_dir(tmp_path, 12)
    tiers = [nvme(tmp_path / "nv"), shared(redis_server.url, namespace="topology")]
    a = dep_factory(model, tiers, tp=writer_tp, canonical=True)
    keys, datas = chunks(4, a.chunk_bytes, b"topology")
    a.store(keys, datas)
    fp = a.tiers[0].fingerprint
    assert fp["parallel"] == "agnostic" and "format=v1-nhd" in fp["layout"]
    a.close()
    b = dep_factory(model, tiers, tp=reader_tp, canonical=True)
    assert b.chunk_bytes == a.chunk_bytes and b.tiers[0].fingerprint == fp
    assert b.load(keys) == datas                                   # from NVMe (a fresh primary)
    b.close()
    c = dep_factory(model, [shared(redis_server.url, namespace="topology")], tp=reader_tp, canonical=True)
    assert c.load(keys) == datas                                   # from the server alone
    c.close()
    bound = dep_factory(model, [shared(redis_server.url, namespace="topology")], tp=reader_tp)
    assert bound.tiers[0].fingerprint["parallel"] == f"world={reader_tp}/tp={reader_tp}/pp=1/pcp=1/dcp=1"
    assert bound.load(keys) == []                                  # not canonical: bound to its topology
