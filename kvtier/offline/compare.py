"""The default eviction policy next to the yardsticks, on any Mooncake-format trace.

For each capacity (a fraction of the trace's unique blocks, or a block count) every policy
is replayed with ``kvtier.offline.sim.simulate`` (the controller on one metadata-only tier)
and Belady's MIN (ties deepest-first) gives the bound. Reported per policy: block and token hit
ratios and the share of the vLLM-ordered-LRU -> Belady gap it closes,
``(hit - vllm_lru) / (belady - vllm_lru)``.
"""

from __future__ import annotations

from typing import Iterator, Sequence

from kvtier.offline.trace import BLOCK_TOKENS, Request, default_trace, load_trace, split_by_time, unique_blocks

FRACTIONS = (0.01, 0.05, 0.1)
BASELINES = ("vllm_lru", "lru", "arc", "s3fifo")


def trace_set(which: str, paths: Sequence[str] = ()) -> Iterator[tuple[str, list[Request]]]:
    """(name, requests) of the issue-12 trace sets: `paths` when given; else "eval" = the
    evaluation seeds of every generated shape + the bundled trace, "tune" = the tuning seeds + the
    bundled trace's first half by time."""
    from kvtier.offline.workloads import EVAL_SEEDS, SHAPES, TUNING_SEEDS, generate
    if paths:
        for p in paths:
            yield p, load_trace(p)
        return
    for seed in EVAL_SEEDS if which == "eval" else TUNING_SEEDS:
        for shape in SHAPES:
            yield f"{shape} seed {seed}", generate(shape, seed)
    reqs = load_trace(default_trace())
    if which == "eval":
        yield "mooncake (bundled)", reqs
    else:
        yield "mooncake first half", split_by_time(reqs)[0]


def gap_closed(hit: float, base: float, best: float) -> float | None:
    """Share of the base -> best gap that `hit` closes (None when there is no gap)."""
    return (hit - base) / (best - base) if best - base > 1e-12 else None


def compare(reqs: Sequence[Request], default: str, fractions: Sequence[float] = FRACTIONS,
            capacity_blocks: int | None = None, block_tokens: int = BLOCK_TOKENS,
            extra: Sequence[str] = ()) -> dict:
    """Rows per capacity: `default`, the baselines, any `extra` policies, and Belady. A policy
    name may be "EVICTION+ADMISSION" (e.g. "lru+second_hit"); a bare name admits every block."""
    from kvtier.offline.belady import belady
    from kvtier.offline.sim import simulate
    from kvtier.offline.trace import make_keys

    u = unique_blocks(reqs)
    keys = make_keys(reqs)
    names = list(dict.fromkeys([default, *BASELINES, *extra]))
    caps = [(None, capacity_blocks)] if capacity_blocks else [(f, max(1, int(f * u))) for f in fractions]
    points = []
    for frac, cap in caps:
        b = belady(reqs, cap, block_tokens=block_tokens)
        rows = {}
        for name in names:
            ev, _, adm = name.partition("+")     # "eviction+admission", e.g. "lru+second_hit"
            s = simulate(reqs, cap, ev, adm or "all", keys=keys, block_tokens=block_tokens)
            rows[name] = {"hit_ratio": s["hit_ratio"], "token_hit_ratio": s["token_hit_ratio"]}
        base = rows["vllm_lru"]["hit_ratio"]
        for r in rows.values():
            r["gap_closed"] = gap_closed(r["hit_ratio"], base, b["hit_ratio"])
        rows["belady"] = {"hit_ratio": b["hit_ratio"], "token_hit_ratio": b["token_hit_ratio"], "gap_closed": 1.0}
        points.append({"fraction": frac, "capacity_blocks": cap, "policies": rows})
    return {"default": default, "unique_blocks": u, "requests": len(reqs),
            "block_refs": sum(len(r.hash_ids) for r in reqs), "points": points}


def text(d: dict) -> str:
    lines = [f"{d['requests']} requests, {d['block_refs']} block refs, {d['unique_blocks']} unique blocks; "
             f"default eviction: {d['default']}; gap = vllm_lru -> belady (MIN, ties deepest-first)"]
    for p in d["points"]:
        head = f"capacity {p['capacity_blocks']} blocks" + (f" ({100 * p['fraction']:g}% of unique)" if p["fraction"] else "")
        lines.append(head)
        lines.append(f"  {'policy':<14}{'block hit':>10}{'token hit':>11}{'gap closed':>12}")
        for name, r in p["policies"].items():
            g = "-" if r["gap_closed"] is None else f"{100 * r['gap_closed']:+.0f}%"
            mark = " (default)" if name == d["default"] else ""
            lines.append(f"  {name:<14}{100 * r['hit_ratio']:>9.2f}%{100 * r['token_hit_ratio']:>10.2f}%{g:>12}{mark}")
    return "\n".join(lines)


def run_compare(args, reqs: Sequence[Request], trace: str) -> int:
    """`kvtier replay --compare`: the default policy (from --policy or the config) vs the yardsticks."""
    from kvtier.core.config import load_config
    cfg = load_config(args.config, check_env=False)
    default = args.policy or cfg.policy.eviction
    adm = args.admission or cfg.policy.admission
    if adm and adm != "all" and "+" not in default:
        default = f"{default}+{adm}"
    fr = [args.capacity_fraction] if args.capacity_fraction else list(FRACTIONS)
    d = compare(reqs, default, fr, args.capacity_blocks, getattr(reqs, "block_tokens", cfg.block_tokens))
    d["trace"] = str(trace)
    if args.json:
        import json
        print(json.dumps(d))
    else:
        print(f"{trace}: " + text(d))
    return 0
