"""Two models whose weights differ only where a sampled digest does not look (layer 0's k/v
projections scaled by 1.5 inside a 6.95 MB file) share nothing through kvtier's persistent tiers:
the second is served no block of the first from NVMe or the shared tier (a real redis-server),
and its greedy tokens equal the second model run alone (real vLLM, CPU build)."""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import vllm_util as U  # noqa: E402

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not U.vllm_available(), reason="vLLM not installed")]

VOCAB = 12800          # a 6.95 MB weight file, layer 0's k/v between the old 64 KiB samples
KV = ("model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight")


def _build(path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, vocab_size=VOCAB, max_position_embeddings=2048,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else None
    model.save_pretrained(path, safe_serialization=True)


def _tensor_spans(f):
    with open(f, "rb") as fh:
        n = struct.unpack("<Q", fh.read(8))[0]
        hdr = json.loads(fh.read(n))
    return {k: (8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1]) for k, v in hdr.items()
            if k != "__metadata__"}


def _scale_in_place(f, names, by):
    import numpy as np
    spans = _tensor_spans(f)
    with open(f, "r+b") as fh:
        for k in names:
            a, b = spans[k]
            fh.seek(a)
            x = np.frombuffer(fh.read(b - a), dtype=np.float32) * by
            fh.seek(a)
            fh.write(x.astype(np.float32).tobytes())


def _sampled_digest(path):
    """The identity kvtier used before: config.json + 16 windows of 64 KiB per weight file."""
    import xxhash
    h = xxhash.xxh3_128()
    h.update(b"config.json\0" + open(os.path.join(path, "config.json"), "rb").read())
    for name in sorted(n for n in os.listdir(path) if n.endswith(".safetensors")):
        with open(os.path.join(path, name), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            h.update(f"{name}\0{size}\0".encode())
            for i in range(16):
                h.update(os.pread(f.fileno(), 65536, max(0, size - 65536) * i // 15))
    return h.hexdigest()


def _kv(tmp_path, url):
    return U.kvtier_config(cpu_capacity_blocks=64, nvme_path=str(tmp_path / "nvme"), nvme_capacity_blocks=256,
                           nvme_on_mismatch="namespace", redis_url=url, data_dir=str(tmp_path / "data"))


def _sched():
    import kvtier.connector as C
    c = C.live_connectors("scheduler")[0]
    assert c.identity.done.wait(120), "weights digest never finished"
    return c


@pytest.mark.timeout(1200)
def test_weights_that_differ_between_old_samples_share_no_kv(tmp_path, redis_server):
    a, b = tmp_path / "a", tmp_path / "b"
    _build(a)
    shutil.copytree(a, b)
    _scale_in_place(b / "model.safetensors", KV, 1.5)
    assert (a / "model.safetensors").read_bytes() != (b / "model.safetensors").read_bytes()
    assert _sampled_digest(a) == _sampled_digest(b)          # the old identity could not tell them apart
    redis_server.client().flushall()
    ps = U.prompts(3, 4, seed=7)
    want = sum((len(p) - 1) // U.BLOCK for p in ps)           # blocks a model could be served

    llm = U.make_llm(str(a), _kv(tmp_path, redis_server.url))
    c = _sched()
    toks_a = U.generate(llm, ps)
    st = dict(c.sched.totals)
    U.shutdown(llm)
    assert st["stored_blocks.nvme"] >= want and st.get("store_planned_blocks.shared", 0) >= want, st
    assert redis_server.client().dbsize() >= want

    llm = U.make_llm(str(b))
    alone = U.generate(llm, ps)
    U.shutdown(llm)
    assert alone != toks_a                                    # the scaled k/v change the tokens

    llm = U.make_llm(str(b), _kv(tmp_path, redis_server.url))
    c = _sched()
    assert c.identity.value != f"weights:{_sampled_digest(b)}"
    toks_b = U.generate(llm, ps)
    st = dict(c.sched.totals)
    U.shutdown(llm)
    assert st.get("hit_blocks.shared", 0) == 0 and st.get("hit_blocks.nvme", 0) == 0, st
    assert st.get("hit_tokens", 0) == 0, st
    assert toks_b == alone


def _totals():
    return dict(_sched().sched.totals)


@pytest.mark.timeout(1200)
def test_hf_overrides_change_the_fingerprint(tmp_path):
    """A restart with `hf_overrides` (another RoPE theta) on the same NVMe directory is served
    nothing the run without them stored: its tokens equal vLLM's own under the same overrides."""
    model = U.build_tiny_llama(tmp_path / "m")
    rope = {"hf_overrides": {"rope_parameters": {"rope_theta": 10.0, "rope_type": "default"}}}
    ps = U.prompts(3, 4, seed=11)
    kv = U.kvtier_config(cpu_capacity_blocks=64, nvme_path=str(tmp_path / "nvme"), nvme_capacity_blocks=256,
                         nvme_on_mismatch="namespace", data_dir=str(tmp_path / "data"))

    llm = U.make_llm(model, **rope)
    alone = U.generate(llm, ps)
    U.shutdown(llm)

    llm = U.make_llm(model, kv)
    plain = U.generate(llm, ps)
    st = _totals()
    U.shutdown(llm)
    assert st["stored_blocks.nvme"] >= sum((len(p) - 1) // U.BLOCK for p in ps), st
    assert plain != alone                                     # the override changes the tokens

    llm = U.make_llm(model, kv, **rope)
    toks = U.generate(llm, ps)
    st = _totals()
    U.shutdown(llm)
    assert st.get("hit_blocks.nvme", 0) == 0 and st.get("hit_tokens", 0) == 0, st
    assert toks == alone


@pytest.mark.timeout(1200)
def test_weights_symlink_flipped_during_the_start(tmp_path, monkeypatch, caplog):
    """The model path is a symlink to v1, flipped to v2 right after vLLM read v1's weights (a
    deploy during the start): the requests run on v1 (tokens equal vLLM's own on v1), the
    persistent tiers stay closed with one line naming the link, and a following server on v2 is
    not served v1's KV (tokens equal vLLM's own on v2)."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    v1 = U.build_tiny_llama(tmp_path / "v1", seed=0)
    v2 = U.build_tiny_llama(tmp_path / "v2", seed=1)
    link = str(tmp_path / "current")
    os.symlink(v1, link)
    ps = U.prompts(3, 4, seed=13)
    kv = U.kvtier_config(cpu_capacity_blocks=64, nvme_path=str(tmp_path / "nvme"), nvme_capacity_blocks=256,
                         nvme_on_mismatch="namespace", data_dir=str(tmp_path / "data"))
    alone = {}
    for v in (v1, v2):
        llm = U.make_llm(v)
        alone[v] = U.generate(llm, ps)
        U.shutdown(llm)
    assert alone[v1] != alone[v2]

    load = DefaultModelLoader.load_weights

    def load_then_flip(self, model, model_config):
        load(self, model, model_config)
        os.unlink(link)
        os.symlink(v2, link)                                  # the deploy flips it: vLLM holds v1

    monkeypatch.setattr(DefaultModelLoader, "load_weights", load_then_flip)
    llm = U.make_llm(link, kv)
    monkeypatch.setattr(DefaultModelLoader, "load_weights", load)
    c = _sched()
    assert os.path.realpath(link) == os.path.realpath(v2)
    toks = U.generate(llm, ps)
    st = dict(c.sched.totals)
    ident = c.identity
    U.shutdown(llm)
    assert toks == alone[v1]
    lines = sum(link in r.getMessage() and "identity is unknown" in r.getMessage() for r in caplog.records)

    llm = U.make_llm(link, kv)                                # a following server, really on v2
    toks2 = U.generate(llm, ps)
    st2 = _totals()
    U.shutdown(llm)
    assert st2.get("hit_blocks.nvme", 0) == 0 and st2.get("hit_tokens", 0) == 0, st2
    assert toks2 == alone[v2]
    assert ident.value is None and link in ident.error, ident.how
    assert st.get("stored_blocks.nvme", 0) == 0 and st.get("not_open_blocks.nvme", 0) > 0, st
    assert st.get("identity_unknown") == 1, st
    assert lines == 1
