"""Stored blocks are in one canonical byte order whatever vLLM's physical KV layout (issue 29,
item 2): a block stored under one layout (NHD, HND, the cross-layer BL* layouts, kernel-block
splits, MLA, any dtype) loads byte-exact under another.

The per-layer views are vLLM's own (`create_kv_cache_views` over one int8 allocation, strides
from `compute_layout_strides`) when vLLM is importable, else the same construction done here:
a physical buffer in the layout's axis order, viewed as the logical `[L, B, H, N, C]`."""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.connector.kv_layout import CANONICAL_FORMAT, CPU_PACKED_FORMAT, KVLayout, layout_name
from kvtier.connector.metadata import KVTierMetadata, LoadOp, StoreOp
from kvtier.connector.worker import KVTierWorker

sys.path.insert(0, os.path.dirname(__file__))
from parts_util import worker_settings  # noqa: E402

try:
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheTensor, MLAAttentionSpec,
                                            compute_layout_strides, create_kv_cache_views)
    from vllm.v1.kv_cache_layout import KVCacheLayout
    ORDERS = {m.name: m.value for m in KVCacheLayout}
    HAVE_VLLM = True
except ImportError:  # the same stride permutations (vLLM's KVCacheLayout, RFC #42082)
    ORDERS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
              "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}
    HAVE_VLLM = False

L, NB = 3, 6
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn]


class Now:
    """`device_copy.Streams` whose copies run as they are queued (the device copier's path)."""

    def fence(self):
        pass

    def side(self):
        return contextlib.nullcontext()

    def record(self):
        return None

    def compute_wait(self, ev):
        pass

    def sync(self, ev):
        pass

    def query(self, ev):
        return True

    def run(self, fn, *args):
        return fn(*args)


def _vllm_views(layout, heads, bs, head, dtype, ratio, mla):
    kb = bs // ratio
    if mla:
        spec = MLAAttentionSpec(block_size=bs, num_kv_heads=1, head_size=head, dtype=dtype)
    else:
        spec = FullAttentionSpec(block_size=bs, num_kv_heads=heads, head_size=head, dtype=dtype)
    lay = KVCacheLayout[layout]
    layer_stride, block_stride, *_ = compute_layout_strides(spec, NB, L, lay)
    size = L * NB * spec.page_size_bytes
    t = KVCacheTensor(size=size, layers=[f"l{i}" for i in range(L)], layer_stride=layer_stride,
                      block_stride=block_stride)
    raw = torch.zeros(size, dtype=torch.int8)
    views = create_kv_cache_views(raw, spec, NB, lay, t, kernel_block_size=kb if ratio > 1 else None)
    return dict(zip(t.layers, views))


def _own_views(layout, heads, bs, head, dtype, ratio, mla):
    heads = 1 if mla else heads
    content = head if mla else 2 * head
    order = ORDERS[layout]
    if ratio > 1 and order[:2] != (0, 1):   # vLLM refuses splits of a non-dense block
        raise ValueError("does not store blocks as dense, unpadded pages")
    logical = (L, NB * ratio, heads, bs // ratio, content)
    phys = torch.zeros([logical[d] for d in order], dtype=dtype)
    inv = [order.index(d) for d in range(5)]
    v5 = phys.permute(*inv)
    return {f"l{i}": v5[i] for i in range(L)}


def views(layout, heads, bs, head, dtype, ratio, mla):
    return (_vllm_views if HAVE_VLLM else _own_views)(layout, heads, bs, head, dtype, ratio, mla)


def as_canonical(t: torch.Tensor, ratio: int) -> torch.Tensor:
    """[NB, H, N, C] logical view of the layer: the kernel blocks' tokens in order."""
    b, h, n, c = t.shape
    return t.view(NB, ratio, h, n, c).permute(0, 2, 1, 3, 4)


def fill(kv: dict, ratio: int, ref: torch.Tensor) -> None:
    for li, t in enumerate(kv.values()):
        dst = as_canonical(t, ratio).view(torch.uint8)
        dst.copy_(ref[li].view(dst.shape))


def canonical_bytes(t: torch.Tensor, ratio: int) -> torch.Tensor:
    """[NB, H, N, C bytes]: what the layer holds, read in canonical order (a copy)."""
    c = as_canonical(t, ratio).view(torch.uint8)
    return c.reshape(NB, c.shape[1], -1, c.shape[-1])


def reference(kv: dict, ratio: int, seed: int) -> torch.Tensor:
    t = next(iter(kv.values()))
    b, h, n, c = t.shape
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (L, NB, h, n * ratio, c * t.element_size()), generator=g, dtype=torch.uint8)


def worker(kv, device_path: bool):
    w = KVTierWorker(worker_settings(NB), num_blocks=NB, copy_streams=Now() if device_path else None)
    w.register_kv_caches(kv)
    return w


CASE = st.tuples(st.sampled_from(sorted(ORDERS)), st.sampled_from([1, 2, 4]), st.booleans())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(src=CASE, dst=CASE, dtype=st.sampled_from(DTYPES), heads=st.sampled_from([1, 2, 3]),
       head=st.sampled_from([4, 8]), mla=st.booleans(), seed=st.integers(0, 2**16))
def test_a_block_stored_under_one_layout_loads_byte_exact_under_another(src, dst, dtype, heads, head, mla, seed):
    bs = 8
    (lay_a, ratio_a, dev_a), (lay_b, ratio_b, dev_b) = src, dst
    try:
        kv_a = views(lay_a, heads, bs, head, dtype, ratio_a, mla)
        kv_b = views(lay_b, heads, bs, head, dtype, ratio_b, mla)
    except ValueError as e:   # a split vLLM refuses for this layout
        assert "dense" in str(e)
        return
    ref = reference(kv_a, ratio_a, seed)
    fill(kv_a, ratio_a, ref)
    a = worker(kv_a, dev_a)
    blocks, slots = [4, 0, 5, 1], [2, 3, 0, 5]
    a.bind(KVTierMetadata(stores=[StoreOp(1, 0, slots, blocks)]))
    a.save()
    assert a.take_report().stored == {1: [True] * 4}
    rows = a.pools[0].buffer.view(NB, -1)
    for b, s in zip(blocks, slots):   # the canonical bytes: layer after layer, [heads, tokens, content]
        assert torch.equal(rows[s], ref[:, b].reshape(-1))
    b_w = worker(kv_b, dev_b)
    b_w.pools[0].buffer.copy_(a.pools[0].buffer)   # the stored rows, served to a stack under layout B
    dst_blocks = [1, 3, 2, 0]
    b_w.bind(KVTierMetadata(loads=[LoadOp("r", 0, slots, dst_blocks)]))
    b_w.start_load()
    assert b_w.take_report().loaded == {"r": True}
    for li, t in enumerate(kv_b.values()):
        got = canonical_bytes(t, ratio_b)
        for sb, db in zip(blocks, dst_blocks):
            assert torch.equal(got[db], ref[li, sb])
        assert not got[[4, 5]].any()      # nothing else written
    a.close()
    b_w.close()


def test_nhd_and_hnd_store_the_same_bytes():
    """The bug as it was: two dense layouts of the same KV stored different bytes."""
    kv_n = views("LBNHC", 2, 8, 4, torch.float32, 1, False)
    kv_h = views("LBHNC", 2, 8, 4, torch.float32, 1, False)
    ref = reference(kv_n, 1, 7)
    fill(kv_n, 1, ref)
    fill(kv_h, 1, ref)
    ln, lh = KVLayout(kv_n, NB), KVLayout(kv_h, NB)
    for b in range(NB):
        assert torch.equal(torch.cat([v.reshape(-1) for v in ln.block_views(b)]),
                           torch.cat([v.reshape(-1) for v in lh.block_views(b)]))


def test_the_format_is_named_in_the_fingerprint():
    """The CPU backend's packed slabs cannot be canonicalised: they get their own name, so a GPU
    stack never serves them (and a CPU stack never serves canonical blocks)."""
    assert layout_name("cpu") == CPU_PACKED_FORMAT
    assert layout_name("cuda") == layout_name("xpu") == CANONICAL_FORMAT != CPU_PACKED_FORMAT


@pytest.mark.skipif(not HAVE_VLLM, reason="vLLM's own view construction")
def test_vllm_and_own_views_agree():
    """The fallback construction (no vLLM) gives the same logical views as vLLM's."""
    for name in ORDERS:
        for ratio in (1, 2):
            try:
                v = _vllm_views(name, 2, 8, 4, torch.float32, ratio, False)
            except ValueError:
                with pytest.raises(ValueError):
                    _own_views(name, 2, 8, 4, torch.float32, ratio, False)
                continue
            o = _own_views(name, 2, 8, 4, torch.float32, ratio, False)
            for a, b in zip(v.values(), o.values()):
                assert a.shape == b.shape
                assert [a.stride(d) for d in range(4)] == [b.stride(d) for d in range(4)], (name, ratio)
