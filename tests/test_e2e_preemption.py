"""Preemption end to end on the CPU build (issue 35 item 1): a KV cache of 10 blocks for 6 growing
requests makes vLLM's own scheduler preempt; with the scheduler side told its stores finish later
(as on a GPU), each step whose `SchedulerOutput` preempts requests carries their blocks in the
metadata (`settle`), and vLLM's model runner hands that metadata to `handle_preemptions` before
the step's forward. The CPU backend's stores complete in the hook, so nothing is waited for here
(tests/test_preemption.py covers the waits, on deferred copies); the tokens equal vLLM's own."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import vllm_util as U  # noqa: E402

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not U.vllm_available(), reason="vLLM not installed")]

SMALL = dict(num_gpu_blocks_override=10, max_model_len=256)
MAX_TOKENS = 60


def test_preempted_requests_blocks_reach_handle_preemptions_and_tokens_match(model_dir, monkeypatch):
    import kvtier.connector as C
    from kvtier.connector import sides
    from kvtier.connector.scheduler import KVTierScheduler

    prompts = U.prompts(6, 2, seed=5, extra=5)
    llm = U.make_llm(model_dir, **SMALL)
    baseline = U.generate(llm, prompts, MAX_TOKENS)
    U.shutdown(llm)

    steps: list[tuple[dict[str, set[int]], set[int]]] = []   # (preempted request -> its blocks, settle)
    on_step = KVTierScheduler.on_step

    def recording_on_step(self, so):
        pre = {rid: {b for t in self._reqs[rid].tables for b in t if b}
               for rid in (so.preempted_req_ids or ()) if rid in self._reqs}
        meta = on_step(self, so)
        steps.append((pre, set(getattr(meta, "settle", ()) or ())))
        return meta

    handed: list[set[int]] = []
    handle = C.KVTierConnector.handle_preemptions

    def recording_handle(self, meta):
        if self.worker is not None:
            handed.append(set(getattr(meta, "settle", ()) or ()))
        return handle(self, meta)

    monkeypatch.setattr(KVTierScheduler, "on_step", recording_on_step)
    monkeypatch.setattr(C.KVTierConnector, "handle_preemptions", recording_handle)
    monkeypatch.setattr(sides, "stores_finish_later", lambda cfg: True)
    llm = U.make_llm(model_dir, U.kvtier_config(config="cpu-only", cpu_capacity_blocks=64), **SMALL)
    try:
        s = [c for c in C.live_connectors("scheduler") if c.sched is not None][0]
        out = U.generate(llm, prompts, MAX_TOKENS)
        preempting = [(pre, settle) for pre, settle in steps if pre]
        assert preempting                                  # vLLM preempted (10 blocks, 6 requests of 5)
        for pre, settle in preempting:                     # every preempted request's blocks named
            for blocks in pre.values():
                assert blocks and blocks <= settle
        named = [settle for _, settle in preempting]
        assert all(any(n <= h for h in handed) for n in named)   # ... and handed to the worker by vLLM
        assert out == baseline
        w = [c for c in C.live_connectors("worker") if c.worker is not None][0]
        assert not [k for k in list(s.sched.totals) + list(w.worker.totals) if k.startswith("hook_errors")]
        assert s.sched.leases.pinned() == 0
    finally:
        U.shutdown(llm)
