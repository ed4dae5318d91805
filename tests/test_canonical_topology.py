"""The canonical block map (issue 37, step 1: `kvtier.connector.canonical`): the parts of a TP
group's ranks tile the block of all KV heads exactly, a block written at one TP size reads back
byte-exact at another (through real `KVLayout`s over NHD / HND views), MLA's latent has one
writer and every rank reads it whole, and what cannot be certified fails closed with its reason.
Cross-checked against vLLM 0.32's own `canonical_mapping` where it runs on CPU."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.connector.canonical import (CANONICAL_FORMAT, CPU_PACKED_FORMAT, Kind, Region, Topology,
                                        canonical_map, layer_kinds, layout_map, slice_count,
                                        slice_pieces, slice_spans)
from kvtier.connector.kv_layout import KVLayout

NB = 4
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def tps(model: list[Region]) -> list[int]:
    """The TP sizes vLLM runs the model at: divisors of the slices, or even replications."""
    S = slice_count(model)
    heads = {r.heads for r in model if r.kind is Kind.HEADS}
    return [t for t in (1, 2, 3, 4, 6, 8, 16) if S % t == 0 or (t % S == 0 and len(heads) <= 1)]


def shard_heads(r: Region, tp: int, rank: int) -> range:
    """vLLM's head sharding: H // tp heads per rank, or one head replicated tp // H times."""
    if r.kind is Kind.LATENT:
        return range(1)
    if tp <= r.heads:
        per = r.heads // tp
        return range(rank * per, (rank + 1) * per)
    h = rank // (tp // r.heads)
    return range(h, h + 1)


def local_row(model, tp, rank):
    return [(len(shard_heads(r, tp, rank)), len(shard_heads(r, tp, rank)) * r.head_bytes) for r in model]


@st.composite
def models(draw):
    heads = draw(st.sampled_from([1, 2, 4, 8, 6, 12]))
    out = []
    for _ in range(draw(st.integers(1, 4))):
        if draw(st.integers(0, 4)) == 0:
            out.append(Region(Kind.LATENT, 1, draw(st.integers(1, 48))))
        else:
            h = heads * draw(st.sampled_from([1, 1, 2]))   # GQA layers may differ by a multiple
            out.append(Region(Kind.HEADS, h, draw(st.integers(1, 24))))
    return out


def intervals_tile(iv: list[tuple[int, int]], size: int) -> bool:
    iv = sorted((a, a + n) for a, n in iv)
    return bool(iv) and iv[0][0] == 0 and iv[-1][1] == size and all(x[1] == y[0] for x, y in zip(iv, iv[1:]))


def merged(iv: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(offset, size) intervals, adjacent ones joined."""
    out: list[tuple[int, int]] = []
    for a, n in sorted(iv):
        if out and out[-1][0] + out[-1][1] == a:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((a, n))
    return out


@FAST
@given(model=models(), data=st.data())
def test_topology_parts_of_a_tp_group_tile_the_canonical_block(model, data):
    tp = data.draw(st.sampled_from(tps(model)))
    whole = sum(r.nbytes for r in model)
    maps = [canonical_map(model, local_row(model, tp, r), Topology(tp=tp, tp_rank=r)) for r in range(tp)]
    assert all(m.certified for m in maps), [m.why for m in maps]
    assert {m.block_bytes for m in maps} == {whole}                   # = the TP=1 row
    for m in maps:
        assert intervals_tile([(s.local, s.size) for s in m.spans], m.local_bytes)
    written = [(s.canonical, s.size) for m in maps for s in m.written()]
    assert intervals_tile(written, whole)                             # no overlap, no gap
    # topology-free part names: the slices tile the block, and each rank's spans are its slices
    S = slice_count(model)
    assert intervals_tile([iv for s in range(S) for iv in slice_spans(model, s)], whole)
    for m in maps:
        lo, hi = m.held
        slices = [iv for s in range(lo, hi) for iv in slice_spans(model, s)]
        if m.writes:       # a writer writes exactly its slices
            assert merged([(s.canonical, s.size) for s in m.written()]) == merged(slices)
        latents = [iv for r, iv in zip(model, slice_spans(model, 0)) if r.kind is Kind.LATENT]
        assert merged([(s.canonical, s.size) for s in m.spans]) == merged(list(set(slices) | set(latents)))
    assert sum(m.writes for m in maps) == min(tp, S)                  # one writer per slice


ORDERS = {"HND": (0, 1, 2, 3), "NHD": (0, 2, 1, 3)}   # physical axis order of [B, H, N, C]


def kv_views(heads: list[int], bs: int, content: int, dtype, order: str, ratio: int = 1) -> dict:
    """Per-layer logical `[B * ratio, H, N / ratio, C]` views over a physical buffer in `order`
    (vLLM's NHD / HND; `ratio` kernel blocks per block)."""
    out = {}
    for i, h in enumerate(heads):
        logical = (NB * ratio, h, bs // ratio, content)
        phys = torch.zeros([logical[d] for d in ORDERS[order]], dtype=dtype)
        inv = [ORDERS[order].index(d) for d in range(4)]
        out[f"l{i}"] = phys.permute(*inv)
    return out


def kinds(kv: dict, kind: Kind) -> dict:
    return {name: kind for name in kv}


def fill(t: torch.Tensor, shard: torch.Tensor) -> None:
    """Layer view `t` ([B * ratio, h, N / ratio, C]) <- `shard` ([B, h, N, C]): kernel blocks' tokens in order."""
    ratio = t.shape[0] // NB
    b, h, n, c = t.shape
    t.view(NB, ratio, h, n, c).permute(0, 2, 1, 3, 4).copy_(shard.reshape(NB, h, ratio, n, c))


def row(lay: KVLayout, b: int) -> torch.Tensor:
    return torch.cat([v.reshape(-1) for v in lay.block_views(b)])


@st.composite
def gqa(draw):
    H = draw(st.sampled_from([1, 2, 4, 8]))
    mla = draw(st.integers(0, 3)) == 0
    return dict(H=1 if mla else H, mla=mla, L=draw(st.integers(1, 3)), bs=draw(st.sampled_from([2, 4])),
                head=draw(st.sampled_from([2, 4])), dtype=draw(st.sampled_from([torch.float16, torch.float32])),
                tp_w=draw(st.sampled_from([1, 2, 4, 8])), tp_r=draw(st.sampled_from([1, 2, 4, 8])),
                order_w=draw(st.sampled_from(sorted(ORDERS))), order_r=draw(st.sampled_from(sorted(ORDERS))),
                ratio_w=draw(st.sampled_from([1, 2])), ratio_r=draw(st.sampled_from([1, 2])),
                seed=draw(st.integers(0, 2**16)))


def rank_layouts(c, tp, order, ratio, ref):
    """Each TP rank's real `KVLayout`, its KV filled with its shard of `ref` ([L, B, H, N, C])."""
    out = []
    content = c["head"] if c["mla"] else 2 * c["head"]
    for rank in range(tp):
        hs = shard_heads(Region(Kind.LATENT if c["mla"] else Kind.HEADS, c["H"], 1), tp, rank)
        kv = kv_views([len(hs)] * c["L"], c["bs"], content, c["dtype"], order, ratio)
        for li, t in enumerate(kv.values()):
            fill(t, ref[li][:, hs.start:hs.stop])
        out.append(KVLayout(kv, NB))
    return out


@FAST
@given(c=gqa())
def test_parallel_agnostic_block_written_at_one_tp_reads_back_at_another(c):
    """A random full-head KV block, sharded by heads as vLLM's TP does, each writer's spans written
    into one canonical block: it is the TP=1 row byte for byte, and every rank at another TP size
    (and another physical layout) reads exactly its own shard from it."""
    content = c["head"] if c["mla"] else 2 * c["head"]
    g = torch.Generator().manual_seed(c["seed"])
    ref = torch.randn(c["L"], NB, c["H"], c["bs"], content, generator=g).to(c["dtype"])
    full = rank_layouts(c, 1, "HND", 1, ref)[0]
    kind = Kind.LATENT if c["mla"] else Kind.HEADS
    block = torch.zeros(full.block_bytes, dtype=torch.uint8)
    b = c["seed"] % NB
    writers = 0
    for rank, lay in enumerate(rank_layouts(c, c["tp_w"], c["order_w"], c["ratio_w"], ref)):
        m = layout_map(lay, c["H"], Topology(tp=c["tp_w"], tp_rank=rank), kinds(lay.layer_of, kind))
        assert m.certified, m.why
        assert m.block_bytes == full.block_bytes
        writers += m.writes
        r = row(lay, b)
        for s in m.written():
            block[s.canonical:s.canonical + s.size] = r[s.local:s.local + s.size]
    assert writers == (1 if c["mla"] else min(c["tp_w"], c["H"]))
    model = [Region(Kind.LATENT, 1, full.layer_bytes[0])] * c["L"] if c["mla"] else \
        [Region(Kind.HEADS, c["H"], full.layer_bytes[0] // c["H"])] * c["L"]
    values = {s: torch.cat([block[o:o + n] for o, n in slice_spans(model, s)]) for s in range(slice_count(model))}
    assert torch.equal(block, row(full, b))                            # the canonical block = the TP=1 row
    for rank, lay in enumerate(rank_layouts(c, c["tp_r"], c["order_r"], c["ratio_r"], ref)):
        m = layout_map(lay, c["H"], Topology(tp=c["tp_r"], tp_rank=rank), kinds(lay.layer_of, kind))
        got = torch.empty(lay.block_bytes, dtype=torch.uint8)
        for s in m.spans:
            got[s.local:s.local + s.size] = block[s.canonical:s.canonical + s.size]
        assert torch.equal(got, row(lay, b))                           # its shard, byte-exact
        for s, pieces in slice_pieces(m, model).items():              # per-slice values, from its row
            assert torch.equal(torch.cat([got[o:o + n] for o, n in pieces]), values[s])
        if c["mla"]:
            assert [(s.canonical, s.size) for s in m.spans] == [
                (i * s.size, s.size) for i, s in enumerate(m.spans)]   # the whole latent
            assert m.writes == (rank == 0)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_mla_topology_one_writer_every_rank_reads_the_whole_latent(tp):
    model = [Region(Kind.LATENT, 1, 576 * 2 * 16)] * 3
    maps = [canonical_map(model, [(1, 576 * 2 * 16)] * 3, Topology(tp=tp, tp_rank=r)) for r in range(tp)]
    assert [m.writes for m in maps] == [True] + [False] * (tp - 1)
    for m in maps:
        assert m.certified and m.slices == 1 and m.held == (0, 1)
        assert [(s.local, s.canonical, s.size) for s in m.spans] == [(i * 18432, i * 18432, 18432) for i in range(3)]


GQA = [Region(Kind.HEADS, 8, 64)] * 2


@pytest.mark.parametrize("model,local,topo,kw,why", [
    ([Region(Kind.HEADS, 3, 64)], [(1, 64)], Topology(tp=2, tp_rank=0), {}, "not divisible by tp 2"),
    ([Region(Kind.HEADS, 2, 64), Region(Kind.HEADS, 4, 64)], [(1, 64), (1, 64)], Topology(tp=4, tp_rank=1), {},
     "does not replicate KV heads [2, 4] evenly"),
    (GQA, [(4, 256)] * 2, Topology(tp=2, dcp=2), {}, "context parallel (dcp 2, pcp 1)"),
    (GQA, [(4, 256)] * 2, Topology(tp=2, pcp=2), {}, "context parallel (dcp 1, pcp 2)"),
    (GQA, [(4, 256)] * 2, Topology(tp=2), {"fmt": "vllm-kv-blocks/someday-v9"}, "unknown KV format"),
    (GQA, [(4, 256)] * 2, Topology(tp=2), {"quant": "FP8_PER_TOKEN_HEAD"}, "KV quantization FP8_PER_TOKEN_HEAD"),
    ([Region(Kind.HEADS, 8, 64), Region(Kind.OPAQUE, 1, 100)], [(4, 256), (1, 100)], Topology(tp=2), {},
     "region 1 is not attention KV"),
    (GQA, [(4, 256)], Topology(tp=2), {}, "lacks model regions"),
    (GQA, [(4, 256), (4, 200)], Topology(tp=2), {}, "region 1: 4 heads in 200 bytes"),
    (GQA, [(2, 128)] * 2, Topology(tp=2), {}, "region 0: 2 heads in 128 bytes, not 4 x 64"),
    ([Region(Kind.LATENT, 1, 96)], [(1, 48)], Topology(tp=2), {}, "latent of 48 bytes, not 96"),
    (GQA, [(4, 256)] * 2, Topology(tp=2, tp_rank=2), {}, "outside tp 2"),
])
def test_uncertified_topology_fails_closed_with_its_reason(model, local, topo, kw, why):
    m = canonical_map(model, local, topo, **kw)
    assert not m.certified and why in m.why
    assert m.spans == () and m.block_bytes == 0 and not m.writes
    assert m.describe() == f"topology-bound blocks ({m.why})"


def test_pipeline_topology_stage_parts_tile_the_model():
    """PP x TP: each stage's ranks hold its regions at their model positions; the writers of all
    stages tile the block. A `KVLayout` alone (no model beyond the stage) fails closed."""
    model = [Region(Kind.HEADS, 4, 32)] * 3 + [Region(Kind.LATENT, 1, 40)]
    stages = [[0, 1], [2, 3]]
    written = []
    for held in stages:
        for r in range(2):
            local = [(len(shard_heads(model[i], 2, r)), len(shard_heads(model[i], 2, r)) * model[i].head_bytes)
                     for i in held]
            m = canonical_map(model, local, Topology(tp=2, tp_rank=r, pp=2), held=held)
            assert m.certified, m.why
            written += [(s.canonical, s.size) for s in m.written()]
    assert intervals_tile(written, sum(r.nbytes for r in model))
    kv = kv_views([2, 2], 4, 8, torch.float16, "HND")
    m = layout_map(KVLayout(kv, NB), 4, Topology(tp=2, pp=2), kinds(kv, Kind.HEADS))
    assert not m.certified and "pipeline stages (pp 2)" in m.why


def test_cpu_packed_format_topology_certifies_and_names_itself():
    """The CPU backend's slabs are heads-outermost, each head its own: certified, in its own format."""
    m = canonical_map(GQA, [(4, 256)] * 2, Topology(tp=2, tp_rank=1), fmt=CPU_PACKED_FORMAT)
    assert m.certified and m.held == (4, 8)
    assert [(s.local, s.canonical) for s in m.spans] == [(0, 256), (256, 768)]
    assert "parallel-agnostic" in m.describe() and "writer" in m.describe()


def test_hybrid_topology_each_region_certifies_or_the_block_is_opaque():
    """Attention groups overlaid on one region (same kind) certify; a state region, a region
    where a state is overlaid on attention pages, or a layer of no known kind make it opaque."""
    kv = kv_views([2, 2], 4, 8, torch.float16, "HND")
    kv["l0_window"] = kv["l0"]                                # a sliding-window group on l0's pages
    both = kinds(kv, Kind.HEADS)
    assert layout_map(KVLayout(kv, NB), 4, Topology(tp=2, tp_rank=1), both).certified
    state = dict(both, l0_window=Kind.OPAQUE)               # a Mamba state overlaid on l0's pages
    m = layout_map(KVLayout(kv, NB), 4, Topology(tp=2), state)
    assert not m.certified and "region 0 is not attention KV" in m.why
    m = layout_map(KVLayout(kv, NB), 4, Topology(tp=2), {"l0": Kind.HEADS, "l0_window": Kind.HEADS})
    assert not m.certified and "region 1 is not attention KV" in m.why
    kv["state"] = torch.zeros(NB, 48, dtype=torch.float16)  # a view that is not [blocks, heads, tokens, content]
    m = layout_map(KVLayout(kv, NB), 4, Topology(tp=2), dict(both, state=Kind.HEADS))
    assert not m.certified and "region 2 is not attention KV" in m.why


# ---- vLLM 0.32's own canonical_mapping, on CPU with plain specs --------------------------------
try:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import canonical_mapping as vllm_cm
except ImportError:   # the properties above need no vLLM
    vllm_cm = None
needs_vllm = pytest.mark.skipif(vllm_cm is None, reason="vLLM 0.32's canonical_mapping")


def _vllm_map(spec, kv, ctx_args, rank):
    ctx = vllm_cm._RankContext(rank=rank, **ctx_args)
    return vllm_cm._layer_mapping(spec, kv, NB, ctx)


def _byte_map(spans_or_runs, local_size, vllm: bool) -> list[int]:
    """canonical byte of each local byte."""
    out = [-1] * local_size
    for r in spans_or_runs:
        if vllm:
            for i in range(r.num_fragments):
                for j in range(r.fragment_size):
                    out[r.local_offset + i * r.local_stride + j] = r.canonical_offset + i * r.canonical_stride + j
        else:
            for j in range(r.size):
                out[r.local + j] = r.canonical + j
    return out


@needs_vllm
@pytest.mark.parametrize("order", ["HND", "NHD"])
@pytest.mark.parametrize("H,tp", [(8, 1), (8, 2), (8, 4), (4, 8), (2, 4), (1, 2)])
def test_parallel_agnostic_regions_match_vllms_canonical_mapping(H, tp, order):
    """For one layer, each rank's page size and writer are vLLM's own (vLLM rotates the writer by
    block id; kvtier's is its writer_index 0), and under HND (kvtier's canonical order) so is
    each byte's place. Under NHD vLLM's canonical page stays token-major; kvtier's does not."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    bs, head, dtype = 4, 8, torch.float16
    hl = max(1, H // tp)
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=hl, head_size=head, dtype=dtype)
    kv = kv_views([hl], bs, 2 * head, dtype, order)["l0"]
    args = dict(tp_size=tp, dcp_size=1, pcp_size=1, interleave=1, total_kv_heads=H)
    for rank in range(tp):
        theirs = _vllm_map(spec, kv, args, rank)
        mine = layout_map(KVLayout({"l0": kv}, NB), H, Topology(tp=tp, tp_rank=rank), {"l0": Kind.HEADS})
        assert theirs is not None and theirs.parallelism_agnostic and mine.certified
        assert mine.block_bytes == theirs.canonical_page_size_bytes
        if order == "HND":
            assert _byte_map(mine.spans, mine.local_bytes, False) == _byte_map(theirs.runs, mine.local_bytes, True)
        assert mine.writes == (theirs.writer_index == 0)


@needs_vllm
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_parallel_agnostic_mla_matches_vllms_canonical_mapping(tp):
    from vllm.v1.kv_cache_interface import MLAAttentionSpec
    bs, latent, dtype = 4, 16, torch.float16
    spec = MLAAttentionSpec(block_size=bs, num_kv_heads=1, head_size=latent, dtype=dtype)
    kv = kv_views([1], bs, latent, dtype, "HND")["l0"]
    args = dict(tp_size=tp, dcp_size=1, pcp_size=1, interleave=1, total_kv_heads=1)
    for rank in range(tp):
        theirs = _vllm_map(spec, kv, args, rank)
        mine = layout_map(KVLayout({"l0": kv}, NB), 1, Topology(tp=tp, tp_rank=rank), {"l0": Kind.LATENT})
        assert mine.block_bytes == theirs.canonical_page_size_bytes == mine.local_bytes
        assert _byte_map(mine.spans, mine.local_bytes, False) == _byte_map(theirs.runs, mine.local_bytes, True)
        assert theirs.num_writers == tp and mine.writes == (theirs.writer_index == 0)


@needs_vllm
@pytest.mark.parametrize("H,tp", [(3, 2), (6, 4)])
def test_uncertified_topology_where_vllm_fails_closed_too(H, tp):
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    hl = max(1, H // tp)
    spec = FullAttentionSpec(block_size=4, num_kv_heads=hl, head_size=8, dtype=torch.float16)
    kv = kv_views([hl], 4, 16, torch.float16, "HND")["l0"]
    args = dict(tp_size=tp, dcp_size=1, pcp_size=1, interleave=1, total_kv_heads=H)
    assert _vllm_map(spec, kv, args, 0) is None
    assert not layout_map(KVLayout({"l0": kv}, NB), H, Topology(tp=tp), {"l0": Kind.HEADS}).certified


@needs_vllm
def test_topology_layer_kinds_from_vllms_kv_cache_config():
    """vLLM's specs decide each layer's kind and the quantization that fails closed."""
    from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheConfig,
                                            KVCacheGroupSpec, KVQuantMode, MambaSpec, MLAAttentionSpec,
                                            SinkFullAttentionSpec, SlidingWindowMLASpec, SlidingWindowSpec)
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
    window = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16, sliding_window=64)
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.float16)
    chunked = ChunkedLocalAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16,
                                        attention_chunk_size=64)
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.float16)
    mamba = MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.float16,))
    swa_mla = SlidingWindowMLASpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.float16,
                                   sliding_window=64)
    sink = SinkFullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16, sink_len=4)
    cfg = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["a0", "a1"], full), KVCacheGroupSpec(["w0"], window), KVCacheGroupSpec(["c0"], chunked),
        KVCacheGroupSpec(["m0"], mla), KVCacheGroupSpec(["s0"], mamba), KVCacheGroupSpec(["x0"], swa_mla),
        KVCacheGroupSpec(["k0"], sink)])
    assert layer_kinds(cfg) == ({"a0": Kind.HEADS, "a1": Kind.HEADS, "w0": Kind.HEADS, "c0": Kind.HEADS,
                                 "m0": Kind.LATENT, "s0": Kind.OPAQUE, "x0": Kind.OPAQUE, "k0": Kind.OPAQUE}, None)
    fp8 = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.uint8,
                            kv_quant_mode=KVQuantMode.FP8_PER_TENSOR)
    pth = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.uint8,
                            kv_quant_mode=KVQuantMode.FP8_PER_TOKEN_HEAD)
    assert layer_kinds(KVCacheConfig(8, [], [KVCacheGroupSpec(["a0"], fp8)]))[1] is None
    assert layer_kinds(KVCacheConfig(8, [], [KVCacheGroupSpec(["a0"], pth)]))[1] == "FP8_PER_TOKEN_HEAD"
    assert CANONICAL_FORMAT != CPU_PACKED_FORMAT
