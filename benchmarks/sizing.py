"""`kvtier plan`'s one pass against three single-capacity replays, and its memory.

Method. For the bundled trace and a generated trace of about `--refs` block references (the
`mix` workload scaled up), in one run:
- curve: `kvtier.offline.sizing.measure` over the requests in memory (the whole LRU curve, exact
  stack distances; then SHARDS at `--sample`);
- replay: `kvtier.offline.replay.replay` on a one-tier metadata-only `lru` stack at 1%, 5% and 10% of
  the unique blocks (what `kvtier replay --no-data --capacity-fraction F` runs after loading
  the trace), the three summed;
each `--repeat` times, interleaved, medians reported, and the ratio curve / three replays.
Memory: a child process streams the trace file through `measure` (the trace is never held)
and reports its peak RSS (VmHWM), next to a child that streams the same file without
measuring; the difference is divided by the unique blocks (exact) or the sampled blocks (SHARDS).

    python benchmarks/sizing.py [--refs 5000000] [--repeat 3] [--sample 0.01] [--skip-big] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, sys, time
from kvtier.offline.sizing import measure
from kvtier.offline.trace import TraceReader

def status(key):  # kB -> bytes; VmHWM is this process's own peak (ru_maxrss counts the parent's at fork)
    line = next(l for l in open("/proc/self/status") if l.startswith(key + ":"))
    return int(line.split()[1]) * 1024

path, mode = sys.argv[1], sys.argv[2]
base = status("VmRSS")
t0 = time.perf_counter()
if mode == "read":
    n = sum(len(r.hash_ids) for r in TraceReader(path))
    out = {"refs": n}
else:
    rate = None if mode == "exact" else float(mode)
    sz = measure(TraceReader(path), sample=rate)
    out = {"refs": sz.refs, "unique": sz.unique_blocks, "sample_blocks": sz.sample_blocks}
out["seconds"] = time.perf_counter() - t0
out["rss_after_imports"] = base
out["peak_rss"] = status("VmHWM")
print(json.dumps(out))
"""


def child(path: str, mode: str) -> dict:
    r = subprocess.run([sys.executable, "-c", CHILD, path, mode], capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def replay_once(reqs, cap: int, bt: int) -> float:
    from kvtier.core.config import parse_config
    from kvtier.offline.replay import replay
    from kvtier.core.stack import TierStack
    cfg = parse_config({"block_bytes": 4096, "block_tokens": bt,
                        "tiers": [{"name": "cpu", "kind": "cpu", "capacity_blocks": cap}],
                        "policy": {"eviction": "lru"}}, source="<bench>", check_env=False)
    t0 = time.perf_counter()
    with TierStack.from_config(cfg, with_data=False) as stack:
        replay(stack, reqs)
    return time.perf_counter() - t0


def bench(name: str, reqs, path: str, repeat: int, sample: float) -> dict:
    from kvtier.offline.sizing import measure
    bt = getattr(reqs, "block_tokens", 512)
    refs = sum(len(r.hash_ids) for r in reqs)
    curve, sampled, three = [], [], []
    sz = None
    for _ in range(repeat):
        t0 = time.perf_counter()
        sz = measure(reqs, bt)
        curve.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ss = measure(reqs, bt, sample=sample)
        sampled.append(time.perf_counter() - t0)
        u = sz.unique_blocks
        three.append(sum(replay_once(reqs, max(1, int(f * u)), bt) for f in (0.01, 0.05, 0.1)))
    read = child(path, "read")
    ex = child(path, "exact")
    sm = child(path, str(sample))
    med = statistics.median
    out = {"trace": name, "requests": len(reqs), "block_refs": refs, "unique_blocks": sz.unique_blocks,
           "curve_s": med(curve), "curve_sampled_s": med(sampled), "three_replays_s": med(three),
           "ratio_curve_to_three_replays": med(curve) / med(three),
           "ratio_sampled_to_three_replays": med(sampled) / med(three),
           "curve_ns_per_ref": 1e9 * med(curve) / refs, "sample_rate": sample, "sample_error": ss.error(),
           "sample_blocks": ss.sample_blocks,
           "streamed": {"read_only": read, "exact": ex, "sampled": sm},
           "rss_exact_bytes_per_unique_block": (ex["peak_rss"] - read["peak_rss"]) / max(1, ex["unique"]),
           "rss_sampled_bytes_per_sampled_block": (sm["peak_rss"] - read["peak_rss"]) / max(1, sm["sample_blocks"]),
           "samples": {"curve_s": curve, "curve_sampled_s": sampled, "three_replays_s": three}}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--refs", type=int, default=5_000_000, help="block references of the generated trace")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--sample", type=float, default=0.01, help="SHARDS rate measured next to the exact pass")
    ap.add_argument("--skip-big", action="store_true", help="only the bundled trace")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.repeat < 1 or a.refs < 1 or not 0 < a.sample <= 1:
        ap.error("--repeat and --refs must be >= 1, --sample in (0, 1]")
    from kvtier.offline.trace import default_trace, load_trace
    from kvtier.offline.workloads import generate, write_trace
    rows = [bench("bundled (Mooncake conversation)", load_trace(default_trace()), str(default_trace()),
                  a.repeat, a.sample)]
    if not a.skip_big:
        scale = a.refs / 736_463   # block refs of mix at scale 1 (seed 1)
        reqs = generate("mix", 1, scale=scale)
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "mix.jsonl")
            write_trace(reqs, p)
            rows.append(bench(f"generated mix x{scale:.2f}", reqs, p, a.repeat, a.sample))
    if a.json:
        print(json.dumps(rows))
        return 0
    print("| trace | refs | unique | curve (exact) | curve (SHARDS) | 3 replays | exact / 3 replays | "
          "peak RSS exact (per unique block) | peak RSS SHARDS (per sampled block) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        s = r["streamed"]
        print(f"| {r['trace']} | {r['block_refs']:,} | {r['unique_blocks']:,} | {r['curve_s']:.2f} s | "
              f"{r['curve_sampled_s']:.2f} s (rate {r['sample_rate']:g}, +/-{100 * r['sample_error']:.1f}%) | "
              f"{r['three_replays_s']:.2f} s | {r['ratio_curve_to_three_replays']:.2f} | "
              f"{s['exact']['peak_rss'] / 2**20:.0f} MiB vs {s['read_only']['peak_rss'] / 2**20:.0f} MiB reading "
              f"({r['rss_exact_bytes_per_unique_block']:.0f} B) | {s['sampled']['peak_rss'] / 2**20:.0f} MiB "
              f"({r['rss_sampled_bytes_per_sampled_block']:.0f} B) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
