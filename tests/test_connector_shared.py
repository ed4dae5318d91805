"""The connector's shared-tier path without vLLM: the scheduler adapter over a real redis-server
and the worker's data plane on vLLM-shaped KV tensors: puts from DRAM, loads (in the step, or
asynchronously: the request waits, its blocks arrive in a later step), a value gone at load."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

from kvtier.core.builder import build_controller, build_tiers
from kvtier.core.config import parse_config
from kvtier.connector.scheduler import KVTierScheduler, SchedulerOptions
from kvtier.connector.worker import KVTierWorker
from kvtier.tiers.shared_conn import Namespace, RedisSettings
from kvtier.tiers.shared_data import SharedData

sys.path.insert(0, os.path.dirname(__file__))
from parts_util import worker_settings  # noqa: E402

NB, H, BS, D2, L = 32, 2, 32, 64, 2
BB = L * H * BS * D2 * 4


class Req:
    def __init__(self, rid: str, hashes: list[bytes], num_tokens: int) -> None:
        self.request_id, self.block_hashes, self.num_tokens, self.arrival_time = rid, hashes, num_tokens, 0.0


def _caches():
    buf = torch.randn(L, NB, H, BS, D2)
    return {f"model.layers.{i}.self_attn.attn": buf[i] for i in range(L)}


def _instance(url: str, tag: str, async_loads: bool):
    cfg = parse_config({"block_bytes": BB, "block_tokens": BS, "model": "conn-shared", "tiers": [
        {"name": "cpu", "kind": "cpu", "capacity_blocks": 16},
        {"name": "shared", "kind": "redis", "url": url, "timeout_s": 0.5}]}, check_env=False)
    s = KVTierScheduler(build_controller(cfg, build_tiers(cfg, "control")),
                        options=SchedulerOptions(async_shared_loads=async_loads))
    t = cfg.tiers[1]
    fp = cfg.fingerprint()
    w = KVTierWorker(worker_settings(16, nvme_write_lag_steps=0),
                     shared_fn=lambda bb, count, model, part, of: SharedData(RedisSettings.of(t), Namespace(fp), bb, count=count))
    caches = _caches()
    w.register_kv_caches(caches)
    return s, w, caches, fp


def _step(s, w, scheduled):
    """One step: plan, worker runs it (load before, save after the forward), report back."""
    meta = s.build_meta([(q, n, None if ids is None else [ids]) for q, n, ids in scheduled])
    w.bind(meta)
    w.start_load()
    w.save()
    done = w.poll_async()
    deadline = time.monotonic() + 30
    while w.loads_in_flight:  # later steps of vLLM's loop (the request waits meanwhile)
        assert time.monotonic() < deadline, "asynchronous load never arrived"
        time.sleep(0.005)
        done |= w.poll_async()
    s.on_worker_meta(w.take_report())
    return meta, done


def _ask(s, req, deadline_s: float = 30.0) -> int:
    """vLLM's lookup loop: None means "ask again next step"."""
    t0 = time.monotonic()
    while (n := s.lookup(req, 0)) is None:
        assert time.monotonic() - t0 < deadline_s
        time.sleep(0.005)
    return n


@pytest.mark.parametrize("async_loads", [False, True])
def test_one_instance_stores_another_loads(redis_server, async_loads):
    tag = f"conn-{async_loads}-{time.monotonic_ns()}"
    hashes = [f"{tag}-{i}".encode().ljust(32, b"_") for i in range(6)]
    a, wa, ca, _ = _instance(redis_server.url, tag, async_loads)
    req = Req("ra", hashes, 6 * BS + 5)
    assert _ask(a, req) == 0
    a.on_alloc(req, [list(range(7))], 0)
    _step(a, wa, [("ra", req.num_tokens, list(range(7)))])
    assert a.ctrl.totals["stored_blocks.shared"] == 6   # written through from DRAM, reported
    b, wb, cb, _ = _instance(redis_server.url, tag, async_loads)
    for t in cb.values():
        t.zero_()
    rb = Req("rb", hashes, 6 * BS + 5)
    assert _ask(b, rb) == 6 * BS
    assert b.loads_async("rb") is async_loads
    dst = list(range(10, 17))
    b.on_alloc(rb, [dst], 6 * BS)
    meta, done = _step(b, wb, [])
    if async_loads:  # the step ran without it; it arrived after (poll) and is reported received
        assert meta.async_loads == ["rb"] and done == {"rb"}
        assert b.on_finished("rb") == (False, None)
    for (na, ta), (nb, tb) in zip(ca.items(), cb.items()):
        for i in range(6):
            assert torch.equal(tb[dst[i]], ta[i])
    assert b.ctrl.totals["hit_blocks.shared"] == 6 and b.ctrl.totals["promoted_blocks.cpu"] == 6
    assert wb.totals["blocks_loaded.shared"] == 6
    for x in (a, b):
        x.close()
    for x in (wa, wb):
        x.close()


def test_async_load_of_a_vanished_block_reports_it(redis_server):
    tag = f"gone-{time.monotonic_ns()}"
    hashes = [f"{tag}-{i}".encode().ljust(32, b"_") for i in range(4)]
    a, wa, ca, fp = _instance(redis_server.url, tag, True)
    req = Req("ra", hashes, 4 * BS + 1)
    _ask(a, req)
    a.on_alloc(req, [list(range(5))], 0)
    _step(a, wa, [("ra", req.num_tokens, list(range(5)))])
    b, wb, cb, _ = _instance(redis_server.url, tag, True)
    rb = Req("rb", hashes, 4 * BS + 1)
    assert _ask(b, rb) == 4 * BS
    key = hashes[2] + (0).to_bytes(4, "big")
    redis_server.client().delete(Namespace(fp).name(key))   # the server evicts it meanwhile
    b.on_alloc(rb, [[20, 21, 22, 23, 24]], 4 * BS)
    _, done = _step(b, wb, [])
    assert done == {"rb"}
    assert wb.take_load_errors() == {22}       # vLLM recomputes from there
    assert b.ctrl.totals["gone_blocks.shared"] == 1
    assert not b.ctrl.tiers[1].holds(key)
    # vLLM recomputes from block 2; the blocks computed then are offered to the store again: the
    # vanished one goes back to DRAM and to the server (the promoted ones are in DRAM already)
    cpu0, sh0 = b.ctrl.totals["stored_blocks.cpu"], b.ctrl.totals.get("stored_blocks.shared", 0)
    _step(b, wb, [("rb", rb.num_tokens, [20, 21, 22, 23, 24])])
    assert b.ctrl.totals["stored_blocks.cpu"] == cpu0 + 1 and b.ctrl.totals["stored_blocks.shared"] == sh0 + 1
    assert redis_server.client().exists(Namespace(fp).name(key))
    for x in (a, b):
        x.close()
    for x in (wa, wb):
        x.close()


def test_finished_while_loading_delays_the_free(redis_server):
    """A request that finishes (abort) while its asynchronous load runs keeps its GPU blocks
    (delay) and its lease until the workers report the load."""
    tag = f"abort-{time.monotonic_ns()}"
    hashes = [f"{tag}-{i}".encode().ljust(32, b"_") for i in range(3)]
    a, wa, _, _ = _instance(redis_server.url, tag, True)
    req = Req("ra", hashes, 3 * BS + 1)
    _ask(a, req)
    a.on_alloc(req, [list(range(4))], 0)
    _step(a, wa, [("ra", req.num_tokens, list(range(4)))])
    b, wb, _, _ = _instance(redis_server.url, tag, True)
    rb = Req("rb", hashes, 3 * BS + 1)
    _ask(b, rb)
    b.on_alloc(rb, [[4, 5, 6, 7]], 3 * BS)
    meta = b.build_meta([])
    assert b.on_finished("rb") == (True, None)   # before the workers ran the load
    assert b.ctrl.leases.leases.get("rb") is not None
    wb.bind(meta)
    wb.start_load()
    deadline = time.monotonic() + 30
    done = set()
    while not done:
        done = wb.poll_async()
        assert time.monotonic() < deadline
        time.sleep(0.005)
    b.on_worker_meta(wb.take_report())
    assert b.ctrl.leases.leases.get("rb") is None and b.ctrl.pinned_blocks() == 0
    for x in (a, b):
        x.close()
    for x in (wa, wb):
        x.close()
