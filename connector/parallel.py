"""Which worker writes which shard of a block under vLLM's parallelism.

Tensor (and pipeline) parallel ranks each hold a different part of every block: each rank stores
its own shard (its NVMe file `data.<rank>`, its own checksum, its own shared-tier keys), and a
block is whole once every rank reported it. MLA under tensor parallelism alone is the exception:
every rank holds the same latent KV, so rank 0 alone writes the NVMe file and the shared tier
(once, as vLLM's own offloading does) and every rank reads what it wrote. Each rank still copies
the blocks it computed into its own DRAM pool (a pool shared across the ranks' processes is not
built yet).

Context parallelism (`context_parallel`) shards tokens, not heads: under decode context parallel
(DCP) one of vLLM's blocks spans `block_size x dcp` tokens (its scheduler block and block hash),
and each DCP rank holds the tokens whose `interleave`-token chunk falls to it, at the same block
id; prefill context parallel (PCP) ranks each hold the block's KV gathered back from the others.
A rank's page of a block is still its own bytes of that block, so each rank writes its own shard
as under TP; dcp, pcp and the interleave are in the fingerprint, since they decide those bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .canonical import CANONICAL_BLOCK_VERSION, FORMATS


def world_size(vllm_config: Any) -> int:
    """Workers holding a shard of every block (tensor x pipeline parallel)."""
    return int(getattr(getattr(vllm_config, "parallel_config", None), "world_size", 1) or 1)


def replicated(vllm_config: Any, kv_cache_config: Any = None) -> bool:
    """Every worker holds the same bytes of every block: an MLA model under tensor parallelism
    and nothing else (no pipeline stages, no context parallelism splitting tokens), with every
    layer's KV the same on all TP ranks where vLLM says so (`kv_tp_replicas`, vLLM 0.32+)."""
    mc, pc = getattr(vllm_config, "model_config", None), getattr(vllm_config, "parallel_config", None)
    if mc is None or pc is None or not getattr(mc, "use_mla", False):
        return False
    tp = int(getattr(pc, "tensor_parallel_size", 1) or 1)
    replicas = getattr(kv_cache_config, "kv_tp_replicas", None)
    return (tp > 1 and world_size(vllm_config) == tp and replicas in (None, tp)
            and int(getattr(pc, "pipeline_parallel_size", 1) or 1) == 1
            and int(getattr(pc, "decode_context_parallel_size", 1) or 1) == 1
            and int(getattr(pc, "prefill_context_parallel_size", 1) or 1) == 1)


def shards(vllm_config: Any, kv_cache_config: Any = None) -> int:
    """Shards of each block written (the ranks the scheduler waits for): 1 when replicated."""
    return 1 if replicated(vllm_config, kv_cache_config) else world_size(vllm_config)


def store_rank(vllm_config: Any, rank: int, kv_cache_config: Any = None) -> int:
    """Whose shard the worker of `rank` writes and reads: rank 0's when replicated."""
    return 0 if replicated(vllm_config, kv_cache_config) else rank


def context_parallel(vllm_config: Any) -> tuple[int, int, int]:
    """(dcp, pcp, interleave) as the workers run them; (1, 1, 1) without context parallelism.
    The interleave is the deprecated `dcp_kv_cache_interleave_size` when that is set: vLLM's
    workers take it over `cp_kv_cache_interleave_size` before their connector is built
    (`VllmConfig.adjust_dcp_kv_cache_interleave_size`), the scheduler's process never does."""
    pc = getattr(vllm_config, "parallel_config", None)
    dcp = int(getattr(pc, "decode_context_parallel_size", 1) or 1)
    pcp = int(getattr(pc, "prefill_context_parallel_size", 1) or 1)
    if dcp * pcp == 1:
        return 1, 1, 1
    interleave = int(getattr(pc, "cp_kv_cache_interleave_size", 1) or 1)
    old = int(getattr(pc, "dcp_kv_cache_interleave_size", 1) or 1)
    return dcp, pcp, old if dcp > 1 and old > 1 else interleave


def context_parallel_refused(vllm_config: Any) -> str | None:
    """Why kvtier does not serve this context parallelism, or None. NIXL P/D under DCP: vLLM's
    workers may re-set the interleave to their block size after the scheduler started, so the
    scheduler's fingerprint could not name the bytes the workers write."""
    dcp, _, _ = context_parallel(vllm_config)
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    if dcp > 1 and ktc is not None and ktc.has_connector("NixlConnector"):
        return (f"decode context parallel (dcp {dcp}) with NixlConnector: vLLM's workers may re-set "
                f"cp_kv_cache_interleave_size after the scheduler started")
    return None


# ---- parts: how a stored block is split, whatever the topology (issue 37) --------------------------
#
# A block in the NVMe and shared tiers is `count` parts (files `data.<p>`, values under part p's
# keys), each `part_bytes` long, committed once the `writers` workers that write them reported. A
# worker holds the parts [lo, hi) and writes them when `writes`. Parallel-agnostic (certified, see
# `canonical.py`): the parts are the canonical block's slices, the same whatever tp wrote them, and
# the fingerprint names them instead of tp and pp. Topology-bound (`why`): part r is rank r's
# shard, as before (one part written by rank 0 when the ranks hold the same KV).

@dataclass(frozen=True)
class Parts:
    count: int                       # parts of a stored block
    writers: int                     # workers whose copies commit a block (the controller's ranks)
    part_bytes: int                  # one part's bytes
    held: tuple[int, int] = (0, 1)   # this worker's parts [lo, hi)
    writes: bool = True              # this worker writes its parts (their one writer)
    why: str | None = None           # topology-bound: why; None: parallel-agnostic

    @property
    def agnostic(self) -> bool:
        return self.why is None

    def describe(self) -> str:
        if self.why is not None:
            return f"topology-bound blocks ({self.why})"
        return (f"parallel-agnostic blocks (canonical v{CANONICAL_BLOCK_VERSION}, {self.count} parts of "
                f"{self.part_bytes} B; parts {self.held[0]}-{self.held[1] - 1}{'' if self.writes else ', reader'})")

    def fingerprint(self) -> dict:
        """What the fingerprint says of the parallel layout instead of tp and pp."""
        return {"block_bytes": self.part_bytes, "parts": self.count, "canonical": CANONICAL_BLOCK_VERSION}


def _bound(vllm_config: Any, kv_cache_config: Any, row_bytes: int, rank: int, why: str) -> Parts:
    n = shards(vllm_config, kv_cache_config)
    r = store_rank(vllm_config, rank, kv_cache_config)
    return Parts(count=n, writers=n, part_bytes=row_bytes, held=(r, r + 1), writes=r == rank, why=why)


def storage_parts(vllm_config: Any, kv_cache_config: Any, row_bytes: int, rank: int = 0,
                  enabled: bool = True) -> Parts:
    """The parts of a stored block under this engine's parallelism, from vLLM's config alone (the
    scheduler and every worker compute the same; a worker checks it against its KV, `check_parts`).
    Parallel-agnostic where kvtier certifies the layout (`canonical.canonical_map`'s rules: GQA /
    MHA heads sharded evenly, or one slice replicated, or an MLA latent; no context or pipeline
    parallelism, KV unquantized or fp8 per tensor, every layer the model's heads; hybrid groups
    where every layer certifies), topology-bound otherwise."""
    from .canonical import Kind, layer_kinds
    from .kv_layout import layout_name

    def bound(why: str) -> Parts:
        return _bound(vllm_config, kv_cache_config, row_bytes, rank, why)
    pc = getattr(vllm_config, "parallel_config", None)
    tp = int(getattr(pc, "tensor_parallel_size", 1) or 1)
    pp = int(getattr(pc, "pipeline_parallel_size", 1) or 1)
    dcp, pcp, _ = context_parallel(vllm_config)
    if not enabled:
        return bound("turned off: serving.parallel_agnostic is false")
    if dcp * pcp > 1:
        return bound(f"context parallel (dcp {dcp}, pcp {pcp}) changes a block's tokens")
    if pp > 1:
        return bound(f"pipeline stages (pp {pp})")
    if world_size(vllm_config) != tp:
        return bound(f"world size {world_size(vllm_config)} is not tp {tp}")
    kinds, quant = layer_kinds(kv_cache_config)
    if quant is not None:
        return bound(f"KV quantization {quant}")
    found = set(kinds.values())
    if not kinds or Kind.OPAQUE in found:
        return bound("a layer that is not attention KV (a state, or an unknown spec)")
    if len(found) > 1:
        return bound("attention heads and an MLA latent in one model")
    fmt = layout_name(str(getattr(getattr(vllm_config, "device_config", None), "device_type", "cuda")))
    if fmt not in FORMATS:
        return bound(f"unknown KV format {fmt!r}")
    if found == {Kind.LATENT}:
        S = 1
    else:
        S = int(vllm_config.model_config.get_total_num_kv_heads())
    if S <= 0:
        return bound("no KV heads")
    heads = _rank_heads(kv_cache_config) if found == {Kind.HEADS} else {max(1, S // tp)}
    if heads != {max(1, S // tp)}:   # a draft model's own heads, or heads vLLM shards otherwise
        return bound(f"layers with {sorted(heads)} KV heads per rank, not {max(1, S // tp)} of {S}")
    if tp <= S and S % tp == 0:
        lo, hi, writes, per = rank * S // tp, (rank + 1) * S // tp, True, S // tp
    elif tp > S and tp % S == 0 and (S == 1 or found == {Kind.HEADS}):
        if S > 1:   # several replicated slices: their writers are not ranks 0..S-1 (not built)
            return bound(f"tp {tp} replicates {S} KV heads")
        lo, hi, writes, per = 0, 1, rank == 0, 1
    else:
        return bound(f"{S} KV heads not divisible by tp {tp}")
    if row_bytes % per:
        return bound(f"a block of {row_bytes} B does not split into {per} parts")
    return Parts(count=S, writers=min(tp, S), part_bytes=row_bytes // per, held=(lo, hi), writes=writes)


def _rank_heads(kv_cache_config: Any) -> set[int]:
    """The KV heads per rank of every attention layer in vLLM's `KVCacheConfig`."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs
    out = set()
    for g in kv_cache_config.kv_cache_groups:
        spec = g.kv_cache_spec
        specs = spec.kv_cache_specs.values() if isinstance(spec, UniformTypeKVCacheSpecs) else [spec]
        out.update(int(x.num_kv_heads) for x in specs)
    return out


def check_parts(parts: Parts, layout: Any, vllm_config: Any, kv_cache_config: Any, rank: int
                ) -> tuple[Parts, list[list[tuple[int, int]]]]:
    """A worker's parts checked against its KV (`layout`, a `KVLayout`): (the parts, for each held
    part its pieces (offset, size) in the worker's row, in order). A parallel-agnostic decision the
    layout does not bear out raises (the worker then serves nothing: loud, never wrong bytes)."""
    if not parts.agnostic or parts.count == 1 and layout.block_bytes == parts.part_bytes:
        # one part (an MLA latent, one KV head): every rank's row is the whole block
        return parts, [[(0, layout.block_bytes)] for _ in range(*parts.held)]
    from .canonical import Topology, layer_kinds, layout_map, model_of, slice_pieces
    from .kv_layout import layout_name
    kinds, quant = layer_kinds(kv_cache_config)
    pc = vllm_config.parallel_config
    topo = Topology(tp=int(pc.tensor_parallel_size), tp_rank=rank % int(pc.tensor_parallel_size))
    H = int(vllm_config.model_config.get_total_num_kv_heads())
    fmt = layout_name(str(vllm_config.device_config.device_type))
    cmap = layout_map(layout, H, topo, kinds, fmt, quant)
    if not cmap.certified or cmap.slices != parts.count or tuple(cmap.held) != parts.held \
            or cmap.writes != parts.writes or cmap.block_bytes != parts.part_bytes * parts.count:
        raise ValueError(f"kvtier: the KV layout does not bear out parallel-agnostic blocks "
                         f"({cmap.describe()}; the config says {parts.describe()}); set "
                         f"serving.parallel_agnostic: false to store topology-bound blocks")
    from kvtier.tiers.parts import merged
    pieces = slice_pieces(cmap, model_of(layout, H, kinds))
    return parts, [merged(pieces[p]) for p in range(*parts.held)]
