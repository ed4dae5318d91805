"""A block stored as parts (issue 37): `tiers.parts.PartsPlane` over per-part NVMe files and
shared-tier values, the per-part tags the controller commits (`ledger.rank_sums`), and the
decision `connector.parallel.storage_parts` takes from vLLM's config (parallel-agnostic where
certified, topology-bound with its reason otherwise). The same in real vLLM at TP=1 and TP=2:
tests/test_e2e_topology.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvtier.connector.canonical import Kind, Region, Topology, canonical_map, slice_pieces
from kvtier.connector.parallel import Parts, storage_parts
from kvtier.core.ledger import rank_sums
from kvtier.policies import EVICTION
from kvtier.tiers.nvme_control import NvmeControl
from kvtier.tiers.nvme_data import NvmeData
from kvtier.tiers.parts import PartsPlane, merged

# two layers of 2 KV heads, 4 KiB per head: slices are 2 parts of 8 KiB
MODEL = [Region(Kind.HEADS, 2, 4096), Region(Kind.HEADS, 2, 4096)]
CANON = sum(r.nbytes for r in MODEL)


def _rank(tp: int, rank: int):
    """(the rank's parts [lo, hi), each part's pieces in its row, its row from a canonical block)."""
    local = [(2 // tp, 2 // tp * 4096)] * 2
    cmap = canonical_map(MODEL, local, Topology(tp=tp, tp_rank=rank))
    assert cmap.certified
    pieces = slice_pieces(cmap, MODEL)

    def row_of(block: torch.Tensor) -> torch.Tensor:
        return torch.cat([block[s.canonical:s.canonical + s.size] for s in cmap.spans])
    return cmap.held, [merged(pieces[p]) for p in range(*cmap.held)], row_of


def _planes(d: str, held, pieces, row_bytes: int) -> PartsPlane:
    return PartsPlane([NvmeData(d, 8, sum(n for _, n in pc), "posix", 1, False, rank=p)
                       for p, pc in zip(range(*held), pieces)], pieces, row_bytes)


@pytest.fixture
def nvme_dir(tmp_path):
    ctl = NvmeControl("nvme", str(tmp_path / "nvme"), 8, CANON // 2, EVICTION.get("lru")(8), {"model": "t"})
    yield ctl.dir
    ctl.close()


def test_parallel_agnostic_parts_written_at_tp1_read_at_tp2_and_back(nvme_dir):
    g = torch.Generator().manual_seed(3)
    blocks = [torch.randint(0, 256, (CANON,), dtype=torch.uint8, generator=g) for _ in range(3)]
    keys, slots = [b"k%d" % i for i in range(3)], [0, 1, 2]
    held1, pieces1, row1 = _rank(1, 0)
    assert held1 == (0, 2)
    tp1 = _planes(nvme_dir, held1, pieces1, CANON)
    w = tp1.write(slots, [row1(b) for b in blocks], keys).wait()
    assert w.ok == [True] * 3 and all(isinstance(t, tuple) and len(t) == 2 for t in w.tags)
    tags = rank_sums({0: w.tags}, 3, 1)   # one writer of both parts
    for r in (0, 1):   # TP=2: rank r reads part r, byte for byte its own row
        held, pieces, row = _rank(2, r)
        assert held == (r, r + 1) and pieces == [[(0, CANON // 2)]]
        plane = NvmeData(nvme_dir, 8, CANON // 2, "posix", 1, False, rank=r)
        dst = [torch.zeros(CANON // 2, dtype=torch.uint8) for _ in blocks]
        got = plane.read(slots, dst, keys, tags).wait()
        assert got.ok == [True] * 3 and all(torch.equal(d, row(b)) for d, b in zip(dst, blocks))
        plane.close()
    # TP=2 writes other blocks, each rank its part; TP=1 reads both parts into its row
    back = [torch.randint(0, 256, (CANON,), dtype=torch.uint8, generator=g) for _ in range(2)]
    by_rank = {}
    for r in (0, 1):
        _, _, row = _rank(2, r)
        plane = NvmeData(nvme_dir, 8, CANON // 2, "posix", 1, False, rank=r)
        res = plane.write([4, 5], [row(b) for b in back], [b"b0", b"b1"]).wait()
        by_rank[r] = res.tags
        plane.close()
    tags2 = rank_sums(by_rank, 2, 2)
    dst = [torch.zeros(CANON, dtype=torch.uint8) for _ in back]
    got = tp1.read([4, 5], dst, [b"b0", b"b1"], tags2).wait()
    assert got.ok == [True, True] and all(torch.equal(d, row1(b)) for d, b in zip(dst, back))
    # a flipped payload byte of part 1: TP=1 and TP=2's rank 1 fail it, rank 0's part still verifies
    with open(f"{nvme_dir}/data.1", "r+b") as f:
        f.seek(4 * tp1.planes[1].stride + 4096 + 9)
        b = f.read(1)
        f.seek(4 * tp1.planes[1].stride + 4096 + 9)
        f.write(bytes([b[0] ^ 1]))
    got = tp1.read([4, 5], [torch.zeros(CANON, dtype=torch.uint8) for _ in back], [b"b0", b"b1"], tags2).wait()
    assert got.ok == [False, True] and got.bad == [True, False]
    for r, want in ((0, [True, True]), (1, [False, True])):
        plane = NvmeData(nvme_dir, 8, CANON // 2, "posix", 1, False, rank=r)
        res = plane.read([4, 5], [torch.zeros(CANON // 2, dtype=torch.uint8) for _ in back], [b"b0", b"b1"],
                         tags2).wait()
        assert res.ok == want
        plane.close()
    tp1.close()


def test_parallel_agnostic_parts_read_into_inference_rows(nvme_dir):
    """vLLM's KV rows are inference tensors: the parts read into scratch and scatter there."""
    held, pieces, row = _rank(1, 0)
    tp1 = _planes(nvme_dir, held, pieces, CANON)
    block = torch.arange(CANON, dtype=torch.int64).remainder(251).to(torch.uint8)
    tags = rank_sums({0: tp1.write([0], [row(block)], [b"k"]).wait().tags}, 1, 1)
    with torch.inference_mode():
        kv = torch.zeros(1, CANON, dtype=torch.uint8)
        h = tp1.read([0], [kv[0]], [b"k"], tags)
    assert h.wait().ok == [True] and torch.equal(kv[0], row(block))
    tp1.close()


def test_rank_sums_flatten_each_writers_parts_in_rank_order():
    assert rank_sums({0: [(1, 2), (5, 6)], 1: [(3, 4), (7, 8)]}, 2, 2) == [(1, 2, 3, 4), (5, 6, 7, 8)]
    assert rank_sums({0: [(1, -1)], 1: [(3, 4)]}, 1, 2) == [-1]
    assert rank_sums({0: [1, 2], 1: [3, -1]}, 2, 2) == [(1, 3), -1]
    assert rank_sums({0: [(1, 2)]}, 1, 1) == [(1, 2)]


# ---- the decision, from vLLM's config -------------------------------------------------------------
def _vllm(tp=1, pp=1, dcp=1, heads=2, mla=False, device="cpu", rank=0):
    pc = SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp, world_size=tp * pp,
                         decode_context_parallel_size=dcp, prefill_context_parallel_size=1,
                         cp_kv_cache_interleave_size=1, dcp_kv_cache_interleave_size=1, rank=rank)
    mc = SimpleNamespace(use_mla=mla, get_total_num_kv_heads=lambda: heads)
    return SimpleNamespace(parallel_config=pc, model_config=mc, device_config=SimpleNamespace(device_type=device),
                           kv_transfer_config=None)


def _kv_config(spec=None, heads: int = 2, draft_heads: int | None = None, window: bool = False):
    """Two full-attention layers of `heads` KV heads per rank (+ a sliding-window group, + a draft
    layer of its own heads)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
    spec = spec or FullAttentionSpec(block_size=16, num_kv_heads=heads, head_size=64, dtype=torch.float16)
    groups = [KVCacheGroupSpec(["a0", "a1"], spec)]
    if window:
        groups.append(KVCacheGroupSpec(["w0", "w1"], SlidingWindowSpec(
            block_size=16, num_kv_heads=heads, head_size=64, dtype=torch.float16, sliding_window=64)))
    if draft_heads is not None:
        groups.append(KVCacheGroupSpec(["d0"], FullAttentionSpec(block_size=16, num_kv_heads=draft_heads,
                                                                 head_size=64, dtype=torch.float16)))
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)


@pytest.mark.parametrize("tp,heads,want", [
    (1, 2, [Parts(2, 1, 4096, (0, 2), True)]),
    (2, 2, [Parts(2, 2, 8192, (0, 1), True), Parts(2, 2, 8192, (1, 2), True)]),
    (2, 8, [Parts(8, 2, 2048, (0, 4), True), Parts(8, 2, 2048, (4, 8), True)]),
    (2, 1, [Parts(1, 1, 8192, (0, 1), True), Parts(1, 1, 8192, (0, 1), False)]),   # one head replicated
])
@pytest.mark.parametrize("window", [False, True])   # a hybrid model whose every layer certifies
def test_parallel_agnostic_parts_of_each_rank(tp, heads, want, window):
    kv = _kv_config(heads=max(1, heads // tp), window=window)
    got = [storage_parts(_vllm(tp=tp, heads=heads, rank=r), kv, 8192, r) for r in range(tp)]
    assert got == want


def test_parallel_agnostic_mla_latent_is_one_part_rank0_writes():
    from vllm.v1.kv_cache_interface import MLAAttentionSpec
    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.float16)
    got = [storage_parts(_vllm(tp=2, heads=1, mla=True, rank=r), _kv_config(spec), 8192, r) for r in (0, 1)]
    assert got == [Parts(1, 1, 8192, (0, 1), True), Parts(1, 1, 8192, (0, 1), False)]


@pytest.mark.parametrize("kw,kv,why", [
    (dict(tp=2, pp=2), dict(heads=1), "pipeline stages (pp 2)"),
    (dict(dcp=2), dict(), "context parallel (dcp 2, pcp 1) changes a block's tokens"),
    (dict(tp=4, heads=2), dict(heads=1), "tp 4 replicates 2 KV heads"),
    (dict(tp=2, heads=3), dict(heads=1), "3 KV heads not divisible by tp 2"),
    (dict(), dict(draft_heads=4), "layers with [2, 4] KV heads per rank, not 2 of 2"),   # a draft's own heads
    (dict(device="tpu-like"), dict(), None),
])
def test_uncertified_topology_stays_bound_and_says_why(kw, kv, why):
    p = storage_parts(_vllm(**kw), _kv_config(**kv), 8192)
    if why is None:   # any device but the CPU backend: the canonical GPU format, certified
        assert p.agnostic
        return
    assert p.why == why and not p.agnostic and p.part_bytes == 8192
    assert p.describe() == f"topology-bound blocks ({why})"
    assert p.held == (0, 1) and p.writes and p.count == p.writers == kw.get("tp", 1) * kw.get("pp", 1)


def test_uncertified_topology_quantized_kv_or_turned_off():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode
    pth = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.uint8,
                            kv_quant_mode=KVQuantMode.FP8_PER_TOKEN_HEAD)
    assert storage_parts(_vllm(), _kv_config(pth), 8192).why == "KV quantization FP8_PER_TOKEN_HEAD"
    off = storage_parts(_vllm(), _kv_config(), 8192, enabled=False)
    assert off.why == "turned off: serving.parallel_agnostic is false" and off.count == 1


def _layout(heads: int):
    from kvtier.connector.kv_layout import KVLayout
    caches = {f"a{i}": torch.zeros(4, heads, 16, 32) for i in range(2)}   # [blocks, heads, tokens, content]
    return KVLayout(caches, 4)


def test_parallel_agnostic_worker_checks_the_config_against_its_kv():
    """Each worker checks the scheduler's decision against its own KV: its parts' pieces come
    from the canonical map; a layout that does not bear the decision out is refused loudly."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvtier.connector.parallel import check_parts
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32)
    lay = _layout(2)   # at TP=1: the model's 2 heads on this rank
    row = lay.block_bytes
    vc = _vllm(tp=1, heads=2)
    parts = storage_parts(vc, _kv_config(spec), row)
    assert parts == Parts(2, 1, row // 2, (0, 2), True)
    got, pieces = check_parts(parts, lay, vc, _kv_config(spec), 0)
    assert got == parts and merged(sorted(sum(pieces, []))) == [(0, row)]   # the parts tile the row
    assert sum(n for p in pieces for _, n in p) == row and all(sum(n for _, n in p) == row // 2 for p in pieces)
    assert pieces[0] != [(0, row // 2)]   # part 0 is head 0 in each layer: not the row's first half
    with pytest.raises(ValueError, match="does not bear out parallel-agnostic blocks"):
        four = _kv_config(heads=4)   # the config says 4 heads, the KV holds 2
        check_parts(storage_parts(_vllm(tp=1, heads=4), four, row), lay, _vllm(tp=1, heads=4), four, 0)
    kv1 = _kv_config(heads=1)
    one = storage_parts(_vllm(tp=2, heads=1), kv1, row, 1)
    assert check_parts(one, lay, _vllm(tp=2, heads=1), kv1, 1) == (one, [[(0, row)]])
