"""The eviction-policy table of docs/policies.md: traces x capacities x policies, % of gap closed.

Each trace is replayed with ``kvtier.offline.compare.compare`` (``kvtier.offline.sim.simulate`` through one
SlotTier per policy; Belady's MIN with ties deepest-first as the bound) at 1%, 5%, 10% of its
unique blocks. Gap closed = (policy - vllm_lru) / (belady - vllm_lru), in block hit ratio.
Policies may be "EVICTION+ADMISSION" (e.g. ``lru+second_hit``).

Traces: by default the generated workloads of every shape with ``kvtier.offline.workloads.EVAL_SEEDS``
plus the bundled Mooncake trace; ``--trace PATH`` (repeatable) replaces them by your own.
``kvtier replay --trace PATH --compare`` is the same comparison for one trace.

    python benchmarks/policy_table.py [--trace PATH ...] [--policies a,b,...] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from kvtier.offline.compare import FRACTIONS, compare, trace_set

POLICIES = ["lru", "arc", "s3fifo", "vllm_lru"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", action="append", default=[])
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    pols = a.policies.split(",")
    t0 = time.time()
    results = []
    for name, reqs in trace_set("eval", a.trace):
        d = compare(reqs, pols[0], FRACTIONS, extra=pols[1:])
        d["trace"] = name
        results.append(d)
        print(f"{name}: done ({time.time() - t0:.0f} s)", file=sys.stderr)
    if a.json:
        print(json.dumps(results))
        return 0
    head = "| trace | cap | vllm_lru | belady | " + " | ".join(p for p in pols if p != "vllm_lru") + " |"
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    gaps: dict[str, list[float]] = {p: [] for p in pols}
    for d in results:
        for pt in d["points"]:
            rows = pt["policies"]
            cells = [f"{100 * rows['vllm_lru']['hit_ratio']:.1f}%", f"{100 * rows['belady']['hit_ratio']:.1f}%"]
            for p in pols:
                if p == "vllm_lru":
                    continue
                g = rows[p]["gap_closed"]
                gaps[p].append(g if g is not None else 0.0)
                cells.append(f"{100 * rows[p]['hit_ratio']:.1f}% ({'-' if g is None else f'{100 * g:+.0f}%'})")
            print(f"| {d['trace']} | {100 * pt['fraction']:g}% | " + " | ".join(cells) + " |")
    print("\n| policy | mean gap closed | worst | points >= 50% | points below vllm_lru |")
    print("|---|---|---|---|---|")
    for p in pols:
        if p == "vllm_lru":
            continue
        g = gaps[p]
        print(f"| {p} | {100 * sum(g) / len(g):+.1f}% | {100 * min(g):+.1f}% | {sum(x >= 0.5 for x in g)}/{len(g)} "
              f"| {sum(x < -1e-9 for x in g)}/{len(g)} |")
    print(f"\n({len(results)} traces, {time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
