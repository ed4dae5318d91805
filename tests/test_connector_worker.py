"""Worker side (data plane): block gather/scatter between vLLM-style KV tensors and the CPU pool."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from kvtier.connector.metadata import KVTierMetadata, LoadOp, CopyOp, StoreOp
from kvtier.tiers.nvme_control import NvmeControl
from kvtier.connector.kv_layout import KVLayout
from kvtier.connector.worker import KVTierWorker
from kvtier.policies.lru import LRU
from kvtier.tiers import io_engine as io_hooks

sys.path.insert(0, os.path.dirname(__file__))
from parts_util import worker_settings  # noqa: E402

NB, H, BS, D2 = 16, 2, 32, 64


def cpu_layout_caches(layers=2):
    """CPU backend shape: each layer [blocks, kv_heads, block_size, 2*head_size], views of one buffer."""
    buf = torch.randn(layers, NB, H, BS, D2)
    return {f"model.layers.{i}.self_attn.attn": buf[i] for i in range(layers)}


def strided_caches(layers=2):
    """A layout whose blocks are not contiguous (heads outermost): the slow path must still work."""
    out = {}
    for i in range(layers):
        t = torch.randn(H, NB, BS, D2).permute(1, 0, 2, 3)
        out[f"l{i}"] = t
    return out


@pytest.mark.parametrize("make", [cpu_layout_caches, strided_caches])
def test_store_load_roundtrip(make):
    caches = make()
    w = KVTierWorker(worker_settings(8))
    w.register_kv_caches(caches)
    assert w.layout.block_bytes == 2 * H * BS * D2 * 4
    orig = {n: t.clone() for n, t in caches.items()}
    w.bind(KVTierMetadata(stores=[StoreOp(1, 0, [0, 5], [3, 11])]))
    w.save()
    res = w.take_report()
    assert res.stored == {1: [True, True]}
    for t in caches.values():
        t[7].zero_()
        t[9].zero_()
    w.bind(KVTierMetadata(loads=[LoadOp("r", 0, [5, 0], [9, 7])]))
    w.start_load()
    assert w.take_report().loaded == {"r": True}
    for n, t in caches.items():
        assert torch.equal(t[7], orig[n][3])
        assert torch.equal(t[9], orig[n][11])
    assert w.totals["blocks_loaded.cpu"] == 2 and w.totals["bytes_stored.cpu"] == 2 * w.layout.block_bytes
    assert not w.take_load_errors()
    w.close()


def test_slot_bytes_are_layer_concatenation():
    caches = cpu_layout_caches()
    w = KVTierWorker(worker_settings(4))
    w.register_kv_caches(caches)
    w.bind(KVTierMetadata(stores=[StoreOp(1, 0, [2], [6])]))
    w.save()
    want = torch.cat([t[6].reshape(-1).view(torch.uint8) for t in caches.values()])
    assert torch.equal(w.pools[0].views[2], want)


def test_load_failure_reports_blocks(monkeypatch):
    w = KVTierWorker(worker_settings(4))
    w.register_kv_caches(cpu_layout_caches())
    monkeypatch.setattr(io_hooks.HOOKS, "counts", {})
    monkeypatch.setattr(io_hooks.HOOKS, "fault", ("load_copy", "error", 1))   # every load fails
    w.bind(KVTierMetadata(loads=[LoadOp("r", 0, [0, 1], [4, 5])]))
    w.start_load()
    assert w.take_report().loaded == {"r": False}
    assert w.take_load_errors() == {4, 5}
    assert w.take_load_errors() == set()


def test_shared_buffers_copied_once():
    t = torch.randn(NB, H, BS, D2)
    lay = KVLayout({"a": t, "b": t})
    assert len(lay.tensors) == 1


def test_worker_meta_aggregate_ands():
    from kvtier.connector.metadata import KVTierWorkerMeta
    a = KVTierWorkerMeta(stored={1: [True, True]}, loaded={"r": True})
    b = KVTierWorkerMeta(stored={1: [True, False]}, loaded={"r": False, "s": True})
    c = a.aggregate(b)
    assert c.stored == {1: [True, False]} and c.loaded == {"r": False, "s": True}


def test_stats_reduce_gbps():
    from kvtier.connector.metadata import KVTierStats
    s = KVTierStats()
    s.add("bytes_loaded.cpu", 2e9)
    s.add("seconds_loaded.cpu", 1.0)
    s.aggregate(KVTierStats(data={"bytes_loaded.cpu": 2e9, "seconds_loaded.cpu": 1.0}))
    assert s.reduce()["gbps_loaded.cpu"] == 2.0
    assert not s.is_empty()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
def test_gpu_roundtrip(layout):  # pragma: no cover - GPU only
    """On a GPU: a pattern a kernel writes after `torch.cuda._sleep` on the compute stream, stored
    at once, is what is stored; a load's compute-stream reads after `wait_layer`, queued before any
    host sync while the side stream is delayed, see the source; with the wait off each goes stale
    (benchmarks/gpu/probes.py, as check.sh runs them)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"))
    import probes

    from kvtier.connector.device_copy import CudaStreams
    with torch.cuda.stream(torch.cuda.Stream()):
        rig = probes.Rig("cuda", CudaStreams(torch.device("cuda")), layout=layout)
        try:
            assert probes.store_probe(rig) and probes.load_probe(rig)
            assert not probes.store_probe(rig, ordered=False)
            assert not probes.load_probe(rig, ordered=False)
        finally:
            rig.close()


def test_runs_of_consecutive_blocks_and_slots():
    from kvtier.connector.kv_layout import runs as _runs
    assert _runs([4, 5, 6, 9, 10, 2], [0, 1, 2, 3, 4, 8]) == [(4, 0, 3, 1, 1), (9, 3, 2, 1, 1), (2, 8, 1, 1, 1)]
    assert _runs([1, 2], [5, 7]) == [(1, 5, 1, 1, 1), (2, 7, 1, 1, 1)]
    assert _runs([10, 9, 8, 0], [0, 1, 2, 3]) == [(10, 0, 3, -1, 1), (0, 3, 1, 1, 1)]  # vLLM hands blocks out in reverse
    assert _runs([3, 4, 5], [2, 1, 0]) == [(3, 2, 3, 1, -1)]
    assert _runs([], []) == []


@pytest.mark.parametrize("one_buffer", [True, False])
def test_scattered_blocks_and_slots_round_trip(one_buffer):
    """Blocks and slots in no order, runs up, down and mixed: every byte lands in its place, both
    with the layers in one allocation (one torch copy per run over all layers) and without (numpy
    copies per layer)."""
    caches = cpu_layout_caches(layers=3) if one_buffer else {f"l{i}": torch.randn(NB, H, BS, D2) for i in range(3)}
    w = KVTierWorker(worker_settings(16))
    w.register_kv_caches(caches)
    assert w.kv.runs_ok and (w.kv.kv3 is not None) == one_buffer
    orig = {n: t.clone() for n, t in caches.items()}
    blocks, slots = [3, 4, 5, 9, 1, 2, 8, 7, 6], [7, 8, 9, 0, 15, 14, 1, 2, 3]
    w.bind(KVTierMetadata(stores=[StoreOp(1, 0, slots, blocks)]))
    w.save()
    w.take_report()
    for t in caches.values():
        t.zero_()
    dst = [10, 11, 12, 0, 15, 14, 13, 4, 5]
    w.bind(KVTierMetadata(loads=[LoadOp("r", 0, slots, dst)]))
    w.start_load()
    assert w.take_report().loaded == {"r": True}
    for n, t in caches.items():
        for b, d in zip(blocks, dst):
            assert torch.equal(t[d], orig[n][b])
    w.close()


@pytest.mark.parametrize("chunk_bytes", [None, 1])
def test_nvme_loads_of_two_requests_in_one_step(tmp_path, chunk_bytes):
    """Two requests loading straight from NVMe (no CPU promotion) in the same step each get their
    own bytes (they once shared one staging buffer: the second read overwrote the first's rows),
    whether the copies run per read chunk or all at once."""
    caches = cpu_layout_caches()
    w = KVTierWorker(worker_settings(8, nvme_write_lag_steps=0))
    w.register_kv_caches(caches)
    if chunk_bytes is not None:
        w.ex.LOAD_CHUNK_BYTES = chunk_bytes   # one block per chunk: copies interleave with reads
    orig = {n: t.clone() for n, t in caches.items()}
    nv = dict(nvme_tier=1, nvme_dir=str(tmp_path / "nvme"), nvme_capacity=16)
    ctl = NvmeControl("nvme", nv["nvme_dir"], 16, w.layout.block_bytes, LRU(16))  # creates the dir and secret
    keys = [b"k%d" % i for i in range(5)]
    w.bind(KVTierMetadata(stores=[StoreOp(1, 0, [0, 1, 2, 3, 4], [1, 2, 3, 4, 5])],
                          copies=[CopyOp(2, [0, 1, 2, 3, 4], [10, 11, 12, 13, 14], keys)], **nv))
    w.save()
    sums = w.take_report().copied[2]
    assert len(sums) == 5 and min(sums) >= 0
    for t in caches.values():
        t[8:14].zero_()
    w.bind(KVTierMetadata(loads=[LoadOp("a", 1, [10, 11, 12], [8, 9, 10], sums[:3], keys=keys[:3]),
                                 LoadOp("b", 1, [13, 14], [12, 13], sums[3:], keys=keys[3:])], **nv))
    w.start_load()
    assert w.take_report().loaded == {"a": True, "b": True}
    for n, t in caches.items():
        for dst, src in ((8, 1), (9, 2), (10, 3), (12, 4), (13, 5)):
            assert torch.equal(t[dst], orig[n][src]), (n, dst, src)
    assert w.totals["blocks_loaded.nvme"] == 5 and not w.take_load_errors()
    w.close()
    ctl.close()
