"""Context parallelism (DCP / PCP) in vLLM's own scheduler (CPU build, no workers launched): kvtier's
block is vLLM's block (`block_size x dcp` tokens, what vLLM hashes), so blocks are stored and hit;
dcp, pcp and the interleave are in the fingerprint; a case kvtier does not serve passes through
with one start line and stores or looks up nothing."""

from __future__ import annotations

import logging
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import vllm_util as U  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not U.vllm_available(), reason="vLLM not installed")]

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    saved = dict(os.environ)
    U.set_env()
    yield U.build_tiny_llama(tmp_path_factory.mktemp("dcp") / "m")
    os.environ.clear()      # the environment the module found (later tests start servers of their own)
    os.environ.update(saved)


def engine_config(model, dcp=1, pcp=1, **kw):
    """vLLM's config of a TP 4 engine (2 KV heads: DCP needs replicated heads) mounting kvtier.
    PCP needs Model Runner V2 (Triton), which the CPU build has not: it is set on the built config."""
    from vllm.engine.arg_utils import EngineArgs
    args = dict(model=model, skip_tokenizer_init=True, dtype="float32", block_size=U.BLOCK, max_model_len=1024,
                enforce_eager=True, enable_prefix_caching=False, tensor_parallel_size=4,
                decode_context_parallel_size=dcp, kv_transfer_config=U.kvtier_config(cpu_capacity_blocks=64))
    args.update(kw)
    vc = EngineArgs(**args).create_engine_config()
    vc.parallel_config.prefill_context_parallel_size = pcp
    vc.cache_config.num_gpu_blocks = NUM_BLOCKS
    return vc


def attention_groups(extra=()):
    """vLLM's KV-cache groups of the tiny model on one TP rank (one KV head), plus `extra`."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    spec = FullAttentionSpec(block_size=U.BLOCK, num_kv_heads=1, head_size=32, dtype=torch.float32)
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec), *extra])


_MADE: list = []


@pytest.fixture(autouse=True)
def _shut_down_schedulers():
    """Each test's vLLM schedulers shut down (their connectors' state heartbeat stops with them)."""
    yield
    while _MADE:
        _MADE.pop().shutdown()


def vllm_scheduler(vc, kvc):
    """vLLM's scheduler, with the block sizes its engine core gives it; it builds kvtier's connector."""
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager
    bs, hash_bs = resolve_kv_cache_block_sizes(kvc, vc)
    s = Scheduler(vc, kvc, StructuredOutputManager(vc), block_size=bs, hash_block_size=hash_bs)
    _MADE.append(s)
    return s, hash_bs


def request(rid, n, hash_bs):
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request
    init_none_hash(sha256)
    return Request(rid, prompt_token_ids=list(range(3, 3 + n)), sampling_params=SamplingParams(max_tokens=1),
                   pooling_params=None, block_hasher=get_request_block_hasher(hash_bs, sha256))


def step(s, rid, stored=True):
    """One step of vLLM's scheduler; every worker reports this step's stores done."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from kvtier.connector.metadata import KVTierWorkerMeta
    out = s.schedule()
    meta = out.kv_connector_metadata
    ranks = s.vllm_config.parallel_config.world_size   # every rank reports its shard of each store
    wm = KVTierWorkerMeta(stored={op.op_id: [stored] * len(op.slots) for op in meta.stores},
                          stored_ranks={op.op_id: {r: [stored] * len(op.slots) for r in range(ranks)}
                                        for op in meta.stores})
    s.update_from_output(out, ModelRunnerOutput(req_ids=[rid], req_id_to_index={rid: 0}, sampled_token_ids=[[7]],
                                                kv_connector_output=KVConnectorOutput(kv_connector_worker_meta=wm)))
    return meta


@pytest.mark.parametrize("dcp,pcp", [(2, 1), (2, 2)])
def test_blocks_are_vllms_blocks_under_dcp(model, dcp, pcp):
    """kvtier's block spans the tokens vLLM hashes (`block_size x dcp`): a prompt's full blocks are
    stored, and the same prompt is served from kvtier, every full block of it."""
    s, hash_bs = vllm_scheduler(engine_config(model, dcp, pcp), attention_groups())
    conn = s.connector
    assert hash_bs == U.BLOCK * dcp
    assert conn.enabled and conn.block_tokens == hash_bs
    assert conn.fingerprint["block_tokens"] == hash_bs
    n = 200
    full = n // hash_bs
    s.add_request(request("a", n, hash_bs))
    meta = step(s, "a")
    assert [len(op.slots) for op in meta.stores] == [full]
    assert conn.sched.totals["stored_blocks.cpu"] == full
    s.add_request(request("b", n, hash_bs))
    meta = step(s, "b")
    assert [(op.req_id, len(op.block_ids)) for op in meta.loads] == [("b", full)]
    assert conn.sched.totals["hit_tokens.cpu"] == full * hash_bs


def test_dcp_pcp_and_the_interleave_are_in_the_fingerprint(model):
    """Another dcp, pcp or interleave writes other bytes per rank: another fingerprint. The
    deprecated dcp_kv_cache_interleave_size is the interleave the workers run (vLLM's workers
    take it over cp_kv_cache_interleave_size). Without context parallelism nothing is added."""
    from kvtier.connector.sides import fingerprint, kv_shape, settings

    def fp(dcp=1, pcp=1, **kw):
        vc = engine_config(model, dcp, pcp, **kw)
        shape = kv_shape(vc, attention_groups())
        return fingerprint(settings({}, shape, False, None), vc, shape, "weights:w")

    base = fp()
    assert not {"dcp", "pcp", "cp_interleave"} & set(base)      # stores written without CP stay valid
    cases = {"dcp 2": fp(2), "pcp 2": fp(1, 2), "dcp 2 pcp 2": fp(2, 2),
             "dcp 2 interleave 8": fp(2, cp_kv_cache_interleave_size=8),
             "dcp 2 interleave 16": fp(2, cp_kv_cache_interleave_size=16)}
    keys = [repr(sorted(v.items())) for v in [base, *cases.values()]]
    assert len(set(keys)) == len(keys), [k for k, v in cases.items() if v == base]
    assert (cases["dcp 2"]["dcp"], cases["pcp 2"]["pcp"], cases["dcp 2 interleave 8"]["cp_interleave"]) == (2, 2, 8)
    assert fp(2, dcp_kv_cache_interleave_size=8) == cases["dcp 2 interleave 8"]


def test_a_hybrid_model_under_dcp_passes_through_with_one_line(model, caplog):
    """A Mamba state group beside attention under DCP (vLLM serves it; kvtier does not know the
    per-rank state under DCP as a shard): the connector says so in one line and is off; vLLM's
    requests run with nothing looked up or stored."""
    import torch
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, MambaSpec
    vc = engine_config(model, 2, enable_prefix_caching=True)
    vc.cache_config.mamba_cache_mode = "align"
    state = MambaSpec(block_size=2 * U.BLOCK, shapes=((4, 512),), dtypes=(torch.float32,), mamba_cache_mode="align")
    kvc = attention_groups([KVCacheGroupSpec(["model.layers.2.mixer"], state)])
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        s, hash_bs = vllm_scheduler(vc, kvc)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("kvtier")]
    assert lines == ["kvtier: connector disabled: context parallelism (dcp 2, pcp 1) with state KV-cache groups: "
                     "kvtier serves only full attention under it"]
    conn = s.connector
    assert not conn.enabled and conn.stats()["enabled"] is False
    for rid in ("a", "b"):
        s.add_request(request(rid, 200, hash_bs))
        meta = step(s, rid)
        assert not meta.stores and not meta.loads
    assert conn.get_num_new_matched_tokens(request("c", 200, hash_bs), 0) == (0, False)
    assert not conn.sched.totals.get("n_lookups") and not conn.sched.totals.get("store_planned_blocks.cpu")
