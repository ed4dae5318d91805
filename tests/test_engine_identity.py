"""The fingerprint's model covers the engine's effective config, built by real vLLM (CPU build)
from a tiny model: an override, the KV-cache dtype or a quantization method changes it; two
identical engines agree (no false misses across identical deployments)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import vllm_util as U  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not U.vllm_available(), reason="vLLM not installed")]


def test_the_effective_config_is_in_the_fingerprint(tmp_path):
    U.set_env()
    from vllm.engine.arg_utils import EngineArgs
    from kvtier.connector.sides import model_key
    model = U.build_tiny_llama(tmp_path / "m")

    def key(**kw):
        args = dict(model=model, skip_tokenizer_init=True, dtype="float32", block_size=U.BLOCK, max_model_len=1024,
                    enforce_eager=True)
        args.update(kw)
        return model_key("weights:w", EngineArgs(**args).create_engine_config())

    base = key()
    assert base.startswith("weights:w;engine=")
    assert key(served_model_name="other", seed=3, max_model_len=512) == base     # nothing of the KV changed
    changed = {
        "rope_theta": key(hf_overrides={"rope_parameters": {"rope_theta": 10.0, "rope_type": "default"}}),
        "rope scaling": key(hf_overrides={"rope_parameters": {"rope_theta": 10000.0, "rope_type": "linear",
                                                              "factor": 2.0}}),
        "max positions": key(hf_overrides={"max_position_embeddings": 4096}),
        "kv_cache_dtype": key(kv_cache_dtype="fp8"),
        "dtype": key(dtype="bfloat16"),
    }
    assert all(v != base for v in changed.values()), [k for k, v in changed.items() if v == base]
    assert len(set(changed.values())) == len(changed)


def test_quantization_is_in_the_fingerprint():
    """The quantization method and its config: a stand-in config object (vLLM's CPU build
    builds no quantized model from the tiny one), digested by class and attributes."""
    import types
    from kvtier.connector.engine_identity import effective_config_digest

    class Fp8Config:
        def __init__(self, scheme):
            self.activation_scheme, self.kv_cache_scheme = scheme, {"type": "float", "num_bits": 8}

    def cfg(quant, qc):
        hf = types.SimpleNamespace(to_dict=lambda: {"model_type": "llama", "rope_theta": 1e4})
        mc = types.SimpleNamespace(hf_config=hf, hf_text_config=hf, quantization=quant, dtype="float16")
        cc = types.SimpleNamespace(cache_dtype="auto")
        return types.SimpleNamespace(model_config=mc, cache_config=cc, quant_config=qc)

    digests = {effective_config_digest(c) for c in (cfg(None, None), cfg("fp8", Fp8Config("static")),
                                                    cfg("fp8", Fp8Config("dynamic")))}
    assert len(digests) == 3
    assert effective_config_digest(cfg("fp8", Fp8Config("static"))) == \
        effective_config_digest(cfg("fp8", Fp8Config("static")))
