"""What the engine makes of the weights: the part of the fingerprint vLLM's config decides.

The same weights give other KV under another effective config: `hf_overrides` (another
`rope_theta`, RoPE scaling, max positions), the quantization method and its config (a
checkpoint's KV-cache scales among them), the model and KV-cache dtypes. `effective_config`
digests the objects vLLM built, after its overrides, rather than fields named one by one, so a
field kvtier did not think of is still covered:

- the model's HF config (`hf_config`, and `hf_text_config` when it is another object), whole,
  without `NOT_KV_HF` (its path and the transformers version that wrote it);
- every field of vLLM's `ModelConfig` but `NOT_KV_MODEL` (paths, names, tokens, serving knobs
  and sizes settled after profiling, none of which changes a KV byte);
- the quantization config vLLM built (`VllmConfig.quant_config`), its class and attributes;
- of `CacheConfig` and `AttentionConfig`: `cache_dtype`, the Mamba state dtypes and mode, the
  skipped layers, the window, and any field whose name holds "dtype", "scale" or "quant" (the
  rest sizes the cache, and is settled while the engine starts).

`weights_pin` resolves the model path for this engine once (`kvtier.core.identity.pin`).
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import json
from typing import Any

import xxhash

from kvtier.core.identity import Weights, pin, process_start_time

NOT_KV_HF = frozenset({"_name_or_path", "name_or_path", "transformers_version", "_commit_hash"})
NOT_KV_MODEL = frozenset({
    "model", "model_weights", "tokenizer", "tokenizer_mode", "tokenizer_revision", "revision", "code_revision",
    "hf_config", "hf_text_config", "hf_config_path", "hf_token", "served_model_name", "seed",
    "allowed_local_media_path", "allowed_media_domains", "max_model_len", "spec_target_max_model_len",
    "enforce_eager", "max_logprobs", "logprobs_mode", "return_sampling_mask", "use_fp64_gumbel",
    "enable_trace_replay", "disable_cascade_attn", "skip_tokenizer_init", "generation_config",
    "override_generation_config", "enable_sleep_mode", "sleep_preserve_parameter_names", "sleep_mode_backend",
    "sleep_mode_offload_cudagraph", "enable_nccl_comm_suspend", "enable_cumem_allocator", "io_processor_plugin",
    "renderer_num_workers", "trust_remote_code", "allow_deprecated_quantization"})
NOT_KV_PREFIXES = ("mm_", "media_", "limit_mm", "interleave_mm", "skip_mm", "video_")
CACHE_FIELDS = ("cache_dtype", "kv_cache_dtype_skip_layers", "mamba_cache_dtype", "mamba_ssm_cache_dtype",
                "mamba_cache_mode", "sliding_window")
CACHE_WORDS = ("dtype", "scale", "quant")


def _plain(x: Any, depth: int = 0) -> Any:
    """`x` as JSON-able data that names no address (objects by class and attributes)."""
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, enum.Enum):
        return f"{type(x).__name__}.{x.name}"
    if isinstance(x, dict):
        return {str(k): _plain(v, depth + 1) for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))}
    if isinstance(x, (list, tuple, set, frozenset)):
        items = [_plain(v, depth + 1) for v in x]
        return sorted(items, key=repr) if isinstance(x, (set, frozenset)) else items
    if isinstance(x, type) or inspect.isroutine(x):
        return f"{getattr(x, '__module__', '')}.{getattr(x, '__qualname__', type(x).__name__)}"
    if hasattr(x, "to_dict") and depth < 4:
        try:
            return _plain(x.to_dict(), depth + 1)
        except Exception:  # noqa: BLE001 - fall back to its attributes
            pass
    attrs = getattr(x, "__dict__", None)
    if isinstance(attrs, dict) and depth < 4:
        return {"__class__": type(x).__qualname__,
                **{k: _plain(v, depth + 1) for k, v in sorted(attrs.items()) if not k.startswith("_")}}
    return f"{type(x).__module__}.{type(x).__qualname__}:{x}"


def _fields(obj: Any) -> list[str]:
    if dataclasses.is_dataclass(obj):
        return [f.name for f in dataclasses.fields(obj)]
    return sorted(k for k in vars(obj) if not k.startswith("_"))


def _hf(cfg: Any) -> dict:
    try:
        d = cfg.to_dict()
    except Exception:  # noqa: BLE001 - not a PretrainedConfig, or one whose to_dict fails: its attributes
        d = dict(vars(cfg))
    return {str(k): _plain(v) for k, v in sorted(d.items(), key=lambda kv: str(kv[0])) if k not in NOT_KV_HF}


def effective_config(vllm_config: Any) -> dict:
    """What of the engine's config the KV bytes depend on, as plain data (see the module)."""
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    out: dict[str, Any] = {"hf_config": _hf(mc.hf_config)}
    text = getattr(mc, "hf_text_config", None)
    if text is not None and text is not mc.hf_config:
        out["hf_text_config"] = _hf(text)
    out["model"] = {k: _plain(getattr(mc, k, None)) for k in _fields(mc)
                    if k not in NOT_KV_MODEL and not k.startswith(NOT_KV_PREFIXES)}
    out["quant_config"] = _plain(getattr(vllm_config, "quant_config", None))
    for name, part in (("cache", cc), ("attention", getattr(vllm_config, "attention_config", None))):
        if part is not None:
            out[name] = {k: _plain(getattr(part, k, None)) for k in _fields(part)
                         if k in CACHE_FIELDS or any(w in k for w in CACHE_WORDS)}
    return out


def effective_config_digest(vllm_config: Any) -> str:
    """xxh3-128 of `effective_config` (sorted JSON)."""
    text = json.dumps(effective_config(vllm_config), sort_keys=True, default=str)
    return xxhash.xxh3_128_hexdigest(text.encode())


def load_source(vllm_config: Any) -> tuple[str, str | None, str | None, Any]:
    """(model path or hub id, revision, hub cache directory, load format) as vLLM loads the weights."""
    mc, lc = vllm_config.model_config, getattr(vllm_config, "load_config", None)
    return (str(mc.model), getattr(mc, "revision", None), getattr(lc, "download_dir", None),
            getattr(lc, "load_format", "auto"))


def weights_pin(vllm_config: Any) -> tuple[Weights, str | None]:
    """What this engine's model path resolves to, pinned at the first call (`identity.pin`)."""
    model, revision, cache_dir, fmt = load_source(vllm_config)
    return pin(str(getattr(vllm_config, "instance_id", "") or ""), model, revision, cache_dir, fmt,
               since=process_start_time())
