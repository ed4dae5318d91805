"""Block hit ratio of every shipped eviction x admission combination on the Mooncake trace.

Whole trace and the held-out second half (split by time; tunable parameters chosen on the
first half only), at 1%, 5%, 10% of the part's unique blocks, next to LRU and Belady (MIN)
at the same capacity, with the share of the LRU -> Belady gap closed. Prints markdown.

    python benchmarks/policy_table.py [--trace PATH] [--jobs N]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from kvtier.belady import belady
from kvtier.sim import make_keys, simulate
from kvtier.trace import load_trace, split_by_time, unique_blocks

from kvtier.trace import default_trace

TRACE = str(default_trace())
FRACS = (0.01, 0.05, 0.10)
EVICTIONS = ["lru", "arc", "s3fifo", "pslru", "nextuse"]
ADMISSIONS = ["all", "second_hit", "continuation"]
# tunable parameters and the candidates tried on the first half
GRID = {
    ("eviction", "pslru"): [dict(levels=lv, ghost_ratio=g, protected_ratio=p)
                            for lv in (2, 4) for g in (2, 8) for p in (0.75, 0.9)],
    ("eviction", "nextuse"): [dict(classes=c, ghost_ratio=g) for c in (2, 4, 6) for g in (4, 8, 16)],
    ("admission", "continuation"): [dict(sample=s) for s in (0.25, 0.5, 1.0)],
}

_PARTS: dict = {}


def _load(path: str) -> None:
    reqs = load_trace(path)
    first, second = split_by_time(reqs)
    for name, part in (("whole", reqs), ("first", first), ("second", second)):
        _PARTS[name] = (part, make_keys(part), unique_blocks(part))


def _run(job):
    part, frac, ev, adm, evp, admp = job
    reqs, keys, u = _PARTS[part]
    cap = max(1, int(frac * u))
    if ev == "belady":
        return job, belady(reqs, cap)
    return job, simulate(reqs, cap, ev, adm, dict(evp), dict(admp), keys=keys)


def _run_all(jobs, nproc, path):
    if nproc <= 1:
        if not _PARTS:
            _load(path)
        return dict((j, r) for j, r in map(_run, jobs))
    with ProcessPoolExecutor(nproc, initializer=_load, initargs=(path,)) as ex:
        return dict(ex.map(_run, jobs, chunksize=1))


def _frz(d):
    return tuple(sorted(d.items()))


def gap(x, lru, opt):
    return (x - lru) / (opt - lru) if opt > lru else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    t0 = time.time()
    # 1. tune on the first half: pick each grid entry by mean gap closed at 1% and 5%
    base = [("first", f, "lru", "all", (), ()) for f in FRACS] + [("first", f, "belady", "", (), ()) for f in FRACS]
    tune = []
    for (kind, name), cands in GRID.items():
        for c in cands:
            for f in FRACS[:2]:
                if kind == "eviction":
                    tune.append(("first", f, name, "all", _frz(c), ()))
                else:
                    tune.append(("first", f, "lru", name, (), _frz(c)))
    res = _run_all(base + tune, args.jobs, args.trace)
    best = {}
    tuning_lines = []
    for (kind, name), cands in GRID.items():
        scored = []
        for c in cands:
            g = []
            for f in FRACS[:2]:
                j = ("first", f, name, "all", _frz(c), ()) if kind == "eviction" else ("first", f, "lru", name, (), _frz(c))
                g.append(gap(res[j]["hit_ratio"], res[("first", f, "lru", "all", (), ())]["hit_ratio"],
                             res[("first", f, "belady", "", (), ())]["hit_ratio"]))
            scored.append((sum(g) / len(g), c))
            tuning_lines.append(f"| {kind} {name} | {c} | " + " | ".join(f"{x:.1%}" for x in g) + " |")
        best[(kind, name)] = max(scored, key=lambda x: x[0])[1]
    # 2. the table: whole trace (defaults) and second half (first-half choices)
    jobs = []
    for part in ("whole", "second"):
        for f in FRACS:
            jobs.append((part, f, "belady", "", (), ()))
            for ev, adm in itertools.product(EVICTIONS, ADMISSIONS):
                evp = _frz(best.get(("eviction", ev), {})) if part == "second" else ()
                admp = _frz(best.get(("admission", adm), {})) if part == "second" else ()
                jobs.append((part, f, ev, adm, evp, admp))
    res2 = _run_all(jobs, args.jobs, args.trace)
    out = []
    for part in ("whole", "second"):
        title = "Whole trace (default parameters)" if part == "whole" else \
            "Held-out second half (parameters chosen on the first half)"
        out.append(f"\n### {title}\n")
        out.append("| eviction | admission | " + " | ".join(f"{int(f*100)}% hit (gap closed)" for f in FRACS) + " |")
        out.append("|---|---|" + "---|" * len(FRACS))
        opt = {f: res2[(part, f, "belady", "", (), ())]["hit_ratio"] for f in FRACS}
        lru = {f: res2[(part, f, "lru", "all", (), ())]["hit_ratio"] for f in FRACS}
        for ev, adm in itertools.product(EVICTIONS, ADMISSIONS):
            cells = []
            for f in FRACS:
                evp = _frz(best.get(("eviction", ev), {})) if part == "second" else ()
                admp = _frz(best.get(("admission", adm), {})) if part == "second" else ()
                x = res2[(part, f, ev, adm, evp, admp)]["hit_ratio"]
                cells.append(f"{x:.1%} ({gap(x, lru[f], opt[f]):+.0%})")
            out.append(f"| {ev} | {adm} | " + " | ".join(cells) + " |")
        out.append("| **belady (MIN)** | — | " + " | ".join(f"{opt[f]:.1%}" for f in FRACS) + " |")
    # speed: LRU on the whole trace, one process
    if not _PARTS:
        _load(args.trace)
    reqs, keys, u = _PARTS["whole"]
    speed = {}
    for ev in EVICTIONS:
        r = simulate(reqs, int(0.05 * u), ev, keys=keys)
        speed[ev] = r["blocks_per_s"]
    print("## Policy table — Mooncake conversation trace\n")
    print("Capacity is a share of the part's unique blocks. Gap closed = (policy - LRU) / (Belady - LRU).")
    print("\n".join(out))
    print("\n### Parameter choice on the first half (gap closed at 1%, 5%)\n")
    print("| policy | params | 1% | 5% |\n|---|---|---|---|")
    print("\n".join(tuning_lines))
    print("\nchosen:", {f"{k[0]} {k[1]}": v for k, v in best.items()})
    print("\n### Replay speed (SlotTier, 5% capacity, one core)\n")
    print("| eviction | blocks/s |\n|---|---|")
    for ev, s in speed.items():
        print(f"| {ev} | {s:,.0f} |")
    print(f"\n(total benchmark time {time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
