"""The canonical block: one block's KV as the model has it, whatever the parallel layout (issue 37).

A rank's row of a block (`kv_layout.KVLayout`) is its regions one after another, each in kvtier's
canonical order `[heads, tokens, content]` (NHD, HND, the cross-layer layouts and kernel-block
splits all read that way; the CPU backend's packed slabs are heads-outermost too). The canonical
block is the same row for the whole model: every region (layer) in model order, each with ALL its
KV heads, `[total heads, tokens, content]`. At TP=1, PP=1 it is byte for byte today's row.

A rank's part: in each region it holds, its heads are one contiguous range (`Span`), at offset
`first head x head bytes` of that region; MLA's latent (`Kind.LATENT`) is the same bytes on every
TP rank and maps whole. Slices name the parts without the topology: S = the gcd of the
head-sharded regions' KV heads (1 when there are none); slice s is heads [s*H/S, (s+1)*H/S) of
each such region, and every latent region belongs to slice 0. A rank holds a contiguous range of
slices; the writer of a slice is the lowest TP rank holding it (one writer for replicated bytes:
the latent, heads replicated when tp exceeds them). The writers' spans tile the block exactly.
A slice's value (what one stored part and its keyed tag cover) is its bytes in every region, in
model order (`slice_spans` in the block, `slice_pieces` in a rank's row).

Certified only where that is provably the model's KV: head-sharded regions whose bytes are
exactly heads x head bytes, every rank holding `max(1, H // tp)` heads, tp dividing the slices
(or the slices dividing tp, replicated evenly); latent regions the same size on every rank; no
context parallelism (it changes the tokens a block spans); KV unquantized or fp8 with per-tensor
scales; a known format. Anything else is opaque and topology-bound, with the reason in one phrase (`why`).
`canonical_map` takes plain numbers, so it is property-tested (tests/test_canonical_topology.py);
`layer_kinds` reads vLLM's `KVCacheConfig`, `layout_map` a rank's `KVLayout`.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .kv_layout import CANONICAL_FORMAT, CPU_PACKED_FORMAT

CANONICAL_BLOCK_VERSION = 1   # bump on any change of the canonical byte order
FORMATS = (CANONICAL_FORMAT, CPU_PACKED_FORMAT)   # heads-outermost per region, each head its own bytes


class Kind(enum.Enum):
    HEADS = "heads"      # GQA / MHA: KV heads outermost, sharded by tensor parallelism
    LATENT = "latent"    # MLA: one latent, the same bytes on every TP rank
    OPAQUE = "opaque"    # anything else (a Mamba state, an unrecognised view): not certifiable


@dataclass(frozen=True)
class Region:
    """One region (layer) as the MODEL has it: `heads` KV heads in all (1 for a latent), each
    `head_bytes` long (tokens x content bytes of one block)."""

    kind: Kind
    heads: int
    head_bytes: int

    @property
    def nbytes(self) -> int:
        return self.heads * self.head_bytes


@dataclass(frozen=True)
class Topology:
    """Where this rank sits: tensor parallel size and rank; pipeline stages; context parallelism."""

    tp: int = 1
    tp_rank: int = 0
    pp: int = 1
    dcp: int = 1
    pcp: int = 1


@dataclass(frozen=True)
class Span:
    """`size` bytes at `local` in the rank's row are at `canonical` in the canonical block;
    `write`: this rank is the one writer of those bytes."""

    local: int
    canonical: int
    size: int
    write: bool


@dataclass(frozen=True)
class CanonicalMap:
    """This rank's part of the canonical block, or why it has none (`why`)."""

    why: str | None
    block_bytes: int                    # the canonical block (0 when not certified)
    local_bytes: int                    # the rank's row
    spans: tuple[Span, ...] = ()        # cover the rank's row exactly, in row order
    regions: tuple[int, ...] = ()       # the model region of each span
    slices: int = 0                     # S: the topology-free part names
    held: tuple[int, int] = (0, 0)      # slices [lo, hi) this rank holds
    writes: bool = False                # this rank writes its slices (their one writer)

    @property
    def certified(self) -> bool:
        return self.why is None

    def written(self) -> tuple[Span, ...]:
        """The spans this rank writes."""
        return tuple(s for s in self.spans if s.write)

    def describe(self) -> str:
        """The start line's phrase."""
        if self.why is not None:
            return f"topology-bound blocks ({self.why})"
        return (f"parallel-agnostic blocks (canonical v{CANONICAL_BLOCK_VERSION}, {self.block_bytes} bytes, "
                f"slices {self.held[0]}-{self.held[1] - 1} of {self.slices}"
                f"{', writer' if self.writes else ', reader'})")


def _opaque(why: str, local_bytes: int) -> CanonicalMap:
    return CanonicalMap(why=why, block_bytes=0, local_bytes=local_bytes)


def slice_count(model: Sequence[Region]) -> int:
    """S: the gcd of the head-sharded regions' KV heads (1 without any)."""
    return math.gcd(*[r.heads for r in model if r.kind is Kind.HEADS]) or 1


def canonical_map(model: Sequence[Region], local: Sequence[tuple[int, int]], topo: Topology,
                  fmt: str = CANONICAL_FORMAT, held: Sequence[int] | None = None,
                  quant: str | None = None) -> CanonicalMap:
    """This rank's part of the canonical block of `model` (every region in model order).

    `local`: the rank's row, one (heads, bytes) per region it holds, in row order; `held`: the
    model index of each (default: 0, 1, ...: no pipeline stages); `quant`: a KV quantization not
    certified (`layer_kinds`). Fails closed:
    a map whose `why` names the first thing that is not certified."""
    local_bytes = sum(b for _, b in local)
    held = list(range(len(local))) if held is None else list(held)
    if fmt not in FORMATS:
        return _opaque(f"unknown KV format {fmt!r}", local_bytes)
    if topo.dcp * topo.pcp > 1:
        return _opaque(f"context parallel (dcp {topo.dcp}, pcp {topo.pcp}) changes a block's tokens", local_bytes)
    if quant is not None:
        return _opaque(f"KV quantization {quant}", local_bytes)
    if not 0 <= topo.tp_rank < topo.tp:
        return _opaque(f"tp rank {topo.tp_rank} outside tp {topo.tp}", local_bytes)
    if len(held) != len(local) or sorted(set(held)) != held or any(not 0 <= i < len(model) for i in held):
        return _opaque("the row's regions are not model regions in model order", local_bytes)
    if topo.pp == 1 and len(held) != len(model):
        return _opaque("the row lacks model regions without pipeline stages", local_bytes)
    opaque = [i for i, r in enumerate(model) if r.kind is Kind.OPAQUE]
    if opaque:
        return _opaque(f"region {opaque[0]} is not attention KV (a state, mixed layers or an unknown view)",
                       local_bytes)
    if any(r.heads <= 0 or r.head_bytes <= 0 for r in model):
        return _opaque("an empty region", local_bytes)
    S, tp, rank = slice_count(model), topo.tp, topo.tp_rank
    if tp <= S:
        if S % tp:
            return _opaque(f"{S} KV head slices not divisible by tp {tp}", local_bytes)
        lo, hi, writes = rank * S // tp, (rank + 1) * S // tp, True
    else:
        heads = {r.heads for r in model if r.kind is Kind.HEADS}
        if tp % S or len(heads) > 1:
            return _opaque(f"tp {tp} does not replicate KV heads {sorted(heads)} evenly", local_bytes)
        rep = tp // S
        lo, writes = rank // rep, rank % rep == 0
        hi = lo + 1
    offsets = [0]
    for r in model:
        offsets.append(offsets[-1] + r.nbytes)
    spans, at = [], 0
    for i, (h, nbytes) in zip(held, local):
        r = model[i]
        if r.kind is Kind.LATENT:
            if h != 1 or nbytes != r.nbytes:
                return _opaque(f"region {i}: latent of {nbytes} bytes, not {r.nbytes}", local_bytes)
            spans.append(Span(at, offsets[i], nbytes, writes and lo == 0))
        else:
            per = r.heads // S
            want = (hi - lo) * per
            if h != want or nbytes != h * r.head_bytes:
                return _opaque(f"region {i}: {h} heads in {nbytes} bytes, not {want} x {r.head_bytes}", local_bytes)
            spans.append(Span(at, offsets[i] + lo * per * r.head_bytes, nbytes, writes))
        at += nbytes
    return CanonicalMap(why=None, block_bytes=offsets[-1], local_bytes=local_bytes, spans=tuple(spans),
                        regions=tuple(held), slices=S, held=(lo, hi), writes=writes)


def _slice_regions(model: Sequence[Region], s: int) -> list[tuple[int, int, int]]:
    """(region, canonical offset, size) of slice `s` in each region it has bytes in."""
    S = slice_count(model)
    out, at = [], 0
    for i, r in enumerate(model):
        if r.kind is Kind.LATENT:
            if s == 0:
                out.append((i, at, r.nbytes))
        else:
            per = r.heads // S
            out.append((i, at + s * per * r.head_bytes, per * r.head_bytes))
        at += r.nbytes
    return out


def slice_spans(model: Sequence[Region], s: int) -> list[tuple[int, int]]:
    """(canonical offset, size) of slice `s` in every region, in model order: what one per-slice
    value (and its keyed tag) holds, whatever topology wrote it."""
    return [(a, n) for _, a, n in _slice_regions(model, s)]


def slice_pieces(cmap: CanonicalMap, model: Sequence[Region]) -> dict[int, list[tuple[int, int]]]:
    """For each slice this rank holds: (offset in the rank's row, size) of its bytes in the
    regions the rank holds, in model order: the slice's value is these pieces of the row, one
    after another (without pipeline stages, the whole `slice_spans`)."""
    span_of = dict(zip(cmap.regions, cmap.spans))
    out = {}
    for s in range(*cmap.held):
        out[s] = [(span_of[i].local + a - span_of[i].canonical, n)
                  for i, a, n in _slice_regions(model, s) if i in span_of]
    return out


CERTIFIED_QUANT = ("NONE", "FP8_PER_TENSOR")   # vLLM's KVQuantMode names whose bytes are per head


def layer_kinds(kv_cache_config: Any) -> tuple[dict[str, Kind], str | None]:
    """(each layer's kind, the first KV quantization not certified or None) from vLLM's
    `KVCacheConfig`, by exact spec type: full, sliding-window and chunked-local attention are head
    pages, MLA a latent; anything else is opaque (a Mamba state, a subclass with more in its page:
    sinks, hidden-state caches, sliding-window MLA...; `tokens_per_state` != 1). Quantization
    other than none or fp8 with per-tensor scales (per-token-head scales, packed fp4 with block
    scales...) keeps scales whose place in a block kvtier does not certify."""
    from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, FullAttentionSpec, MLAAttentionSpec,
                                            SlidingWindowSpec, UniformTypeKVCacheSpecs)

    by_type = {FullAttentionSpec: Kind.HEADS, SlidingWindowSpec: Kind.HEADS, ChunkedLocalAttentionSpec: Kind.HEADS,
               MLAAttentionSpec: Kind.LATENT}
    kinds: dict[str, Kind] = {}
    quant = None
    for g in kv_cache_config.kv_cache_groups:
        spec = g.kv_cache_spec
        per_layer = spec.kv_cache_specs if isinstance(spec, UniformTypeKVCacheSpecs) else {}
        for name in g.layer_names:
            s = per_layer.get(name, spec)
            kind = by_type.get(type(s), Kind.OPAQUE)
            if kind is not Kind.OPAQUE and s.tokens_per_state != 1:
                kind = Kind.OPAQUE
            if kind is not Kind.OPAQUE and s.kv_quant_mode.name not in CERTIFIED_QUANT:
                quant = quant or s.kv_quant_mode.name
            kinds[name] = kind
    return kinds, quant


def model_of(layout: Any, total_kv_heads: int, kinds: Mapping[str, Kind]) -> list[Region]:
    """The model's regions as a `KVLayout` without pipeline stages implies them. A region's kind
    is that of every layer using it (`kinds`; layers of different kinds overlaid on one region, or a
    layer not named, make it opaque). A head-sharded region's view is `[blocks, heads, tokens,
    content]`: `total_kv_heads` heads of `bytes / heads` each; a latent's is one head."""
    used: dict[int, set[Kind]] = {}
    for name, i in layout.layer_of.items():
        used.setdefault(i, set()).add(kinds.get(name, Kind.OPAQUE))
    out = []
    for i, (t, nbytes) in enumerate(zip(layout.tensors, layout.layer_bytes)):
        k = used[i].pop() if len(used[i]) == 1 else Kind.OPAQUE
        h = int(t.shape[1]) if t.dim() == 4 else 0
        if k is Kind.OPAQUE or h == 0 or nbytes % h or (k is Kind.LATENT and h != 1):
            out.append(Region(Kind.OPAQUE, 1, nbytes))
        elif k is Kind.LATENT:
            out.append(Region(Kind.LATENT, 1, nbytes))
        else:
            out.append(Region(Kind.HEADS, total_kv_heads, nbytes // h))
    return out


def layout_map(layout: Any, total_kv_heads: int, topo: Topology, kinds: Mapping[str, Kind],
               fmt: str = CANONICAL_FORMAT, quant: str | None = None) -> CanonicalMap:
    """`canonical_map` of a rank's `KVLayout` (its row: each region's heads and block bytes), its
    layers' kinds from `layer_kinds`. Pipeline stages fail closed here: the other stages' regions
    are not in this rank's layout."""
    local = [(int(t.shape[1]) if t.dim() == 4 else 1, b) for t, b in zip(layout.tensors, layout.layer_bytes)]
    if topo.pp > 1:
        return _opaque(f"pipeline stages (pp {topo.pp}): the other stages' regions are not known here",
                       sum(b for _, b in local))
    return canonical_map(model_of(layout, total_kv_heads, kinds), local, topo, fmt,
                        quant=quant)
