"""Tenants inside real vLLM (CPU build): two cache_salts are two tenants in kvtier's counters,
its /metrics gauges and its recorded trace; the same prompt under another salt is another
tenant's blocks."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import vllm_util as U  # noqa: E402

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not U.vllm_available(), reason="vLLM not installed")]

BLOCKS = 4
MAX_TOKENS = 8


def _generate(llm, prompts, salts):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p, cache_salt=s) for p, s in zip(prompts, salts)], sp,
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_two_cache_salts_are_two_tenants(tmp_path):
    import kvtier.connector as C
    model = U.build_tiny_llama(tmp_path / "m")
    y = tmp_path / "t.yaml"
    y.write_text("tiers:\n  - {name: cpu, kind: cpu, capacity_blocks: 64}\n"
                 "tenants:\n  quotas:\n    alice: {cpu: 50%}\n    bob: {cpu: 25%}\n"
                 f"serving: {{record_trace: {tmp_path / 'rec.jsonl'}}}\n")
    p = U.prompts(1, BLOCKS, seed=11)[0]
    stored = (len(p) + MAX_TOKENS - 1) // U.BLOCK      # full blocks of prompt + generated tokens
    full = (len(p) - 1) // U.BLOCK                     # blocks a request may load
    llm = U.make_llm(model, U.kvtier_config(config=str(y)))
    try:
        [s] = [c for c in C.live_connectors("scheduler") if c.sched is not None]
        [first] = _generate(llm, [p], ["alice"])
        t = s.sched.totals
        assert t["tenant_stored_blocks.cpu|alice"] == stored and t.get("tenant_hit_blocks.cpu|alice", 0) == 0
        # the same tokens under bob's salt hash to other blocks: a miss, stored as bob's
        assert _generate(llm, [p], ["bob"]) == [first]
        assert t["tenant_stored_blocks.cpu|bob"] == stored and t.get("tenant_hit_blocks.cpu|bob", 0) == 0
        assert _generate(llm, [p, p], ["alice", "bob"]) == [first, first]
        assert t["tenant_hit_blocks.cpu|alice"] == full and t["tenant_hit_blocks.cpu|bob"] == full
        assert not any(k.endswith("|other") for k in t), t
        g = s.sched_stats.gauges()
        bb = s.sched.tiers[0].block_bytes
        assert g["gauge_tenant_bytes.cpu|alice"] == stored * bb and g["gauge_tenant_bytes.cpu|bob"] == stored * bb
        assert g["gauge_tenant_bytes.cpu|other"] == 0
        st = s.sched.stats()["tenants"]
        assert st["alice"]["cpu"]["quota_blocks"] == 32 and st["bob"]["cpu"]["quota_blocks"] == 16
    finally:
        U.shutdown(llm)
    from kvtier.offline.trace import load_trace   # the recorded trace names each request's tenant
    assert sorted(r.tenant for r in load_trace(str(tmp_path / "rec.jsonl"))) == ["alice", "alice", "bob", "bob"]
