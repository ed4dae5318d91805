"""A secondary tier's dict (vLLM's ``secondary_tiers`` entry) -> a validated kvtier stack, and
the fingerprint that binds every chunk to the model and the chunk geometry.

The options are kvtier's YAML tier keys (docs/configuration.md), checked by the same schema:
an unknown key or a bad value is one line naming the key. vLLM's own keys (``type``,
``module_path``, ``backpressure``) never reach here; ``locality`` is taken as vLLM's fs tier
takes it.
"""

from __future__ import annotations

import re
from typing import Any

from kvtier import FORMAT_VERSION
from kvtier.core.config import ConfigError, StackConfig, parse_config

# kvtier's YAML keys each tier kind takes from the secondary tier's dict
NVME_KEYS = ("path", "capacity", "capacity_blocks", "io", "io_threads", "direct", "on_fingerprint_mismatch",
             "eviction", "encryption")
SHARED_KEYS = ("url", "cluster", "username", "password", "tls_ca", "timeout_s", "connect_timeout_s", "pool_size",
               "batch_bytes", "secret", "io_threads", "encryption")
OWN_KEYS = ("name", "namespace", "model_identity")   # ours, not a YAML tier key


def one_line(err: ConfigError, where: str) -> str:
    """kvtier's multi-line validation message as one line, the keys named as in the tier's dict."""
    lines = [ln.strip() for ln in str(err).splitlines()]
    body = [ln for ln in lines[1:] if ln] or [lines[0].split(": ", 1)[-1]]
    out = []
    for ln in body:
        ln = ln.replace(f"{where}: ", "")
        out.append(re.sub(r"tiers[.\[]1\]?[.:]?\s*", "", ln))
    return f"{where}: " + "; ".join(out)


def tier_stack(kind: str, tier_type: str, options: dict[str, Any], block_bytes: int,
               block_tokens: int, fingerprint: dict[str, Any]) -> StackConfig:
    """The one-tier kvtier stack (a nominal DRAM tier above it, as YAML requires) for `options`.
    Raises ConfigError with one line naming the key."""
    where = f"secondary tier {tier_type}"
    keys = NVME_KEYS if kind == "nvme" else SHARED_KEYS
    for k in options:
        if k not in keys:
            raise ConfigError(f"{where}: {k}: unknown key (takes: {', '.join(sorted(keys + OWN_KEYS))})")
    tier = {"name": options.get("name", "nvme" if kind == "nvme" else "shared"), "kind": kind,
            **{k: v for k, v in options.items()}}
    if kind == "nvme" and "path" not in tier:
        raise ConfigError(f"{where}: path: missing (the directory of the NVMe tier)")
    if kind == "nvme" and "eviction" in tier:
        from kvtier.policies import EVICTION
        if tier["eviction"] not in EVICTION.classes:
            raise ConfigError(f"{where}: eviction: unknown policy {tier['eviction']!r}; "
                              f"known: {', '.join(EVICTION.names())}")
    data = {"block_bytes": block_bytes, "block_tokens": block_tokens, "model": fingerprint["model"],
            "dtype": fingerprint["dtype"], "layout": fingerprint["layout"],
            "tiers": [{"name": "dram", "kind": "cpu", "capacity_blocks": 1}, tier]}
    try:
        return parse_config(data, source=where)
    except ConfigError as e:
        raise ConfigError(one_line(e, where)) from None


def chunk_fingerprint(spec: Any, block_bytes: int, namespace: str | None = None,
                      model_identity: str | None = None) -> dict[str, Any]:
    """What the bytes of one of vLLM's offload chunks depend on: the model (by the digest of its
    weights, `core.identity`), the KV dtype and layout, the chunk geometry (groups, their
    tokens and layers, blocks per chunk, bytes) and the parallelism whose workers' bytes the
    chunk concatenates; `namespace` separates deployments further by choice.

    Under vLLM's `canonical_layout`, where vLLM certifies the chunk's bytes as the same whatever
    the parallel layout (`parallel_agnostic`, as vLLM's fs tier decides it), the chunk is named
    without tp/pp/dcp/pcp and by vLLM's canonical byte format instead: a cache written at TP=2
    serves TP=1 and TP=4 of the same model."""
    from kvtier.core.digest_cache import default_data_dir
    from kvtier.core.identity import model_identity as identify
    c = spec.config
    ident, how = (model_identity, "") if model_identity else identify(c.model.name, data_dir=default_data_dir())
    if ident is None:   # weights unreadable: no identity, so nothing may be shared under one
        raise ConfigError(f"model_identity: the model {c.model.name}'s identity is unknown ({how}); "
                          "give model_identity to name its weights")
    groups = ";".join(f"{g.group_id}:{g.tokens_per_block}:{len(g.layer_names)}" for g in c.groups)
    p = c.parallel
    tokens = sum(g.tokens_per_block for g in c.groups[:1]) * c.cache.blocks_per_chunk
    fp = {"model": ident, "dtype": str(c.model.dtype),
          "layout": f"{c.kv_cache_layout or 'default'}/canonical={int(c.canonical_layout)}"
                    f"/replicated={int(bool(getattr(spec, 'replicated_layout', False)))}",
          "block_bytes": block_bytes, "block_tokens": tokens, "rank": 0, "format_version": FORMAT_VERSION,
          "geometry": f"groups={groups}/chunk={c.cache.blocks_per_chunk}x{c.worker_kv_bytes_per_block}B"
                      f"/hash={c.cache.tokens_per_hash}",
          "parallel": f"world={p.world_size}/tp={p.tp_size}/pp={p.pp_size}/pcp={p.pcp_size}/dcp={p.dcp_size}",
          "source": "vllm-native"}
    if parallel_agnostic(c):
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import canonical_format_id
        fp["layout"] += f"/format={canonical_format_id(c.kv_cache_layout)}"
        fp["geometry"] = f"groups={groups}/chunk={c.cache.blocks_per_chunk}/hash={c.cache.tokens_per_hash}"
        fp["parallel"] = "agnostic"
    if namespace:
        fp["namespace"] = str(namespace)
    return fp


def parallel_agnostic(c: Any) -> bool:
    """vLLM certified the chunk's bytes as independent of the parallel layout: its canonical layout
    is on and every layer maps portably (or the replicated MLA layout), the rule vLLM's fs tier
    applies (`FileMapper.from_spec(parallel_agnostic=True)`)."""
    return bool(c.canonical_layout) and c.kv_cache_layout is not None and bool(
        c.parallel.is_parallelism_agnostic or c.replicated_layout)
