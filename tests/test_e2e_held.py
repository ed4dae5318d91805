"""vLLM's delay-free protocol end to end on the CPU build (`scheduler.StoreHolds`, `worker.SendingRequests`): the CPU
backend's stores complete in the hook, so it never holds a request; here the scheduler side is
told its stores finish later (as on a GPU), so a request whose last step stored a block is held
(`request_finished` -> True: vLLM's scheduler runs `request_finished` before it reads the step's
report) and released by the workers' `finished_sending` in a later step, through vLLM's own
scheduler (which asserts a released request is still held and frees it once)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import vllm_util as U  # noqa: E402

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not U.vllm_available(), reason="vLLM not installed")]

BLOCKS, EXTRA = 2, 5
MAX_TOKENS = 3 * U.BLOCK - (BLOCKS * U.BLOCK + EXTRA) + 1   # the third block fills in the last step


def test_held_requests_are_released_by_vllm_once_and_tokens_match(model_dir, monkeypatch):
    import kvtier.connector as C
    from kvtier.connector import sides

    prompts = U.prompts(4, BLOCKS, seed=11, extra=EXTRA)
    llm = U.make_llm(model_dir)
    baseline = U.generate(llm, prompts, MAX_TOKENS)
    U.shutdown(llm)

    monkeypatch.setattr(sides, "stores_finish_later", lambda cfg: True)
    llm = U.make_llm(model_dir, U.kvtier_config(config="cpu-only", cpu_capacity_blocks=64))
    try:
        s = [c for c in C.live_connectors("scheduler") if c.sched is not None][0]
        holds = s.sched.holds
        assert holds.enabled
        first = U.generate(llm, prompts, MAX_TOKENS)
        held = set(holds.held)
        assert len(held) == len(prompts)          # each stored its third block in its last step
        second = U.generate(llm, prompts, MAX_TOKENS)   # its steps release the first pass's requests
        assert not holds.held and not holds.ops and not holds.announce   # its blocks were all stored
        assert first == baseline and second == baseline
        assert s.sched.totals["hit_tokens"] == len(prompts) * BLOCKS * U.BLOCK
        assert s.sched.leases.pinned() == 0
    finally:
        U.shutdown(llm)
