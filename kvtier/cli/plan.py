"""`kvtier plan`: size the tiers from a trace (the curves come from `kvtier.offline.sizing`).

For each tier of the stack: block and token hit ratio, load bytes and the modelled TTFT saved as
a function of its capacity (the other tiers as configured), next to Belady's MIN at a few points;
a suggested YAML for a target hit ratio or a DRAM budget; a PNG; `--json`. Fleet mode
(`--instances N`): N instances with their own local tiers and one shared tier.

Tier model (inclusive LRU): tier i holds the max(C_0..C_i) most recent blocks of one LRU order,
and a block hits the topmost tier holding it. It is what inclusive promotion and write-through
keep, and exact when the lower tier never evicts (it holds every block the trace stores) or is no
larger than the tier above (it then serves nothing). Under write-back a lower tier holds the
blocks evicted from above rather than a copy of them, so its hits lie between this model and the
exclusive one (capacity C_i-1 + C_i); plan gives both. The gpu tier is vLLM's block pool, sized by
vLLM at start-up: plan, like replay, models the tiers kvtier owns.
"""

from __future__ import annotations

import argparse
import itertools
import math
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.core.config import ConfigError, StackConfig, load_config
from kvtier.cli.replay import load_gbps
from kvtier.offline.replay import DEFAULT_LOAD_GBPS, DEFAULT_PREFILL_TPS
from kvtier.offline.sizing import MIN_SAMPLE_BLOCKS, ROUTINGS, Sizing, belady_points, capacity_grid, measure
from kvtier.offline.trace import TraceReader, apply_geometry, default_trace
from kvtier.common.units import format_size, parse_size

FRACTIONS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)   # table rows: shares of the unique blocks
BELADY_FRACTIONS = (0.01, 0.05, 0.1)


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="size the tiers from a trace: hit ratio vs capacity per tier, a suggested YAML")
    p.add_argument("--trace", default=None, help="Mooncake JSONL (default: the bundled conversation trace)")
    p.add_argument("--config", "-c", default=None, help="YAML tier stack (default: the embedded cpu-nvme)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--target-hit", default=None, metavar="R",
                   help="suggest a stack reaching block hit ratio R (0.4 or 40%%)")
    g.add_argument("--budget", default=None, metavar="SIZE",
                   help="suggest a stack with SIZE of DRAM, e.g. 64GiB (fleet mode: SIZE of shared tier)")
    p.add_argument("--instances", type=int, default=1, help="fleet mode: N instances and one shared tier")
    p.add_argument("--routing", choices=ROUTINGS, default=None, help="fleet mode: request routing (default random)")
    p.add_argument("--sample", type=float, default=None, metavar="RATE",
                   help="SHARDS sampling of the blocks at RATE in (0, 1] for huge traces (default: exact)")
    p.add_argument("--limit", type=int, default=None, help="only the first N requests")
    p.add_argument("--png", default=None, metavar="PATH", help="plot the curves with the configured capacities marked")
    p.add_argument("--no-belady", action="store_true",
                   help="skip Belady (it holds the trace in memory; the curve alone streams it)")
    p.add_argument("--prefill-tokens-per-s", type=float, default=None,
                   help=f"cost model: prefill speed of the served model (default: the one the recorded trace "
                        f"states, else {DEFAULT_PREFILL_TPS:.0f}, assumed)")
    p.add_argument("--trust-block-tokens", action="store_true",
                   help="take the trace's block size as given even when its input lengths contradict it")
    p.add_argument("--load-gbps", default=None,
                   help="cost model: per-tier load bandwidth, e.g. 'cpu=20,nvme=5' (default by tier kind)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bars (plan has none)")


def _target(v: str) -> float:
    s = str(v).strip()
    try:
        x = float(s[:-1]) / 100 if s.endswith("%") else float(s)
    except ValueError:
        raise ConfigError(f"--target-hit {v!r}: expected a ratio like 0.4 or 40%") from None
    if not 0 < x < 1:
        raise ConfigError(f"--target-hit {v!r}: must be between 0 and 1 (0% and 100%), exclusive")
    return x


def _check_args(args: argparse.Namespace) -> None:
    """Every argument, before any work: one line naming the first bad one."""
    if args.limit is not None and args.limit <= 0:
        raise ConfigError(f"--limit must be > 0, got {args.limit}")
    if args.sample is not None and not (0 < args.sample <= 1):
        raise ConfigError(f"--sample must be a rate in (0, 1], got {args.sample}")
    if not 1 <= args.instances <= 4096:
        raise ConfigError(f"--instances must be between 1 and 4096, got {args.instances}")
    if args.routing is not None and args.instances == 1:
        raise ConfigError("--routing needs --instances N with N > 1 (fleet mode)")
    if args.target_hit is not None:
        _target(args.target_hit)
    if args.budget is not None:
        try:
            if parse_size(args.budget) <= 0:
                raise ValueError("must be > 0")
        except ValueError as e:
            raise ConfigError(f"--budget {args.budget!r}: {e}") from None
    if args.png is not None and not Path(args.png).resolve().parent.is_dir():
        raise ConfigError(f"--png {args.png}: {Path(args.png).resolve().parent}: no such directory [ENOENT]")
    tps = args.prefill_tokens_per_s
    if tps is not None and not (tps > 0 and math.isfinite(tps)):
        raise ConfigError(f"--prefill-tokens-per-s must be a finite number > 0, got {tps}")
    load_gbps(args)


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    trace = Path(args.trace) if args.trace else default_trace()
    if trace.is_dir():
        raise ConfigError(f"--trace: {trace}: is a directory, not a trace file [EISDIR]")
    if not trace.is_file():
        raise ConfigError(f"--trace: {trace}: no such file (set KVTIER_TRACE or pass --trace)")
    base = load_config(args.config, check_env=False)
    reader = TraceReader(trace, args.limit, args.trust_block_tokens)
    it = iter(reader)
    first = next(it, None)
    if first is None:
        raise ConfigError(f"--trace: {trace}: no requests in the trace (empty, or only blank lines)")
    from kvtier.offline.tenant_plan import ByTenant, plan_tenants
    byt = ByTenant(itertools.chain([first], it))   # keeps the requests that carry a tenant
    reqs: Any = byt
    if not args.no_belady:   # Belady holds the trace; the curve alone streams it (memory: the unique blocks)
        reqs = list(reqs)
    bt = reader.block_tokens
    cfg, note = apply_geometry(base, bt, reader.geometry)
    local, shared = _tiers(cfg)
    fleet = args.instances > 1
    sz = measure(reqs, bt, args.sample, args.instances, args.routing or "random",
                 max((c for _, c in local), default=0))
    measured = (reader.geometry or {}).get("prefill_tokens_per_s")   # the latest header's: read to the end now
    if args.prefill_tokens_per_s is None:
        args.prefill_tokens_per_s = float(measured or DEFAULT_PREFILL_TPS)
        args.prefill_source = "measured by the server (the trace's header)" if measured else "assumed (default)"
    else:
        args.prefill_source = "--prefill-tokens-per-s"
    rep = report(sz, cfg, cfg, args, local, shared)
    if byt.by:   # the trace names tenants: each one's own curve (kvtier/offline/tenant_plan.py)
        rep["tenants"] = plan_tenants(byt.by, bt, cfg, *(local[0] if local else (None, 0)), args.sample)
    rep["trace"] = str(trace)
    rep["geometry"] = reader.geometry
    rep["geometry_note"] = note
    rep["warnings"][:0] = reader.warnings
    if not args.no_belady and not fleet:  # a fleet has no one cache to bound
        rep["belady"], rep["belady_method"] = _belady(reqs, sz, [c for _, c in _effective(local, shared, sz)], bt)
    if args.png:
        from kvtier.offline.sizing_plot import plot
        rep["png_layout"] = plot(rep, sz, args.png)
        rep["png"] = rep["png_layout"]["path"]
    if args.json:
        import json
        print(json.dumps(rep))
    else:
        print(text(rep))
    return 0


def _tiers(cfg: StackConfig) -> tuple[list[tuple[Any, int]], tuple[Any, int] | None]:
    """(tier config, capacity in blocks) of the local tiers, and of the shared tier (0: unbounded)."""
    local, shared = [], None
    for t in cfg.storage_tiers():
        if t.kind == "shared":
            shared = (t, t.blocks(cfg.block_bytes))
        else:
            local.append((t, t.blocks(cfg.block_bytes)))
    return local, shared


def _effective(local, shared, sz: Sizing) -> list[tuple[Any, int]]:
    """Single instance: each tier's reach in the inclusive model (max of its capacity and those
    above; an unbounded shared tier reaches every block)."""
    out, m = [], 0
    for t, c in local + ([shared] if shared else []):
        m = max(m, c if c else sz.unique_blocks)
        out.append((t, m))
    return out


def _gbps(args: argparse.Namespace, t) -> float:
    by = load_gbps(args)
    return by.get(t.name, by.get(t.kind, DEFAULT_LOAD_GBPS.get(t.kind, 5.0)))


def _stack_point(sz: Sizing, reach: list[tuple[Any, int]], args, bb: int) -> dict:
    """Per tier hits and the stack's totals when the tiers reach `reach` (inclusive model)."""
    caps = np.array([c for _, c in reach], dtype=np.float64)
    cum = sz.hit_ratio(caps) if len(caps) else np.zeros(0)
    tps = args.prefill_tokens_per_s
    tiers, prev, load_s = [], 0.0, 0.0
    for (t, c), r in zip(reach, cum):
        hr = max(0.0, float(r) - prev)
        prev = max(prev, float(r))
        blocks = hr * sz.refs
        ls = blocks * bb / (_gbps(args, t) * 1e9)
        load_s += ls
        tiers.append({"name": t.name, "kind": t.kind, "reach_blocks": int(c), "hit_ratio": hr,
                      "token_hit_ratio": blocks * sz.block_tokens / max(1, sz.input_tokens),
                      "load_bytes": int(blocks * bb), "load_s": ls})
    hit_tokens = prev * sz.refs * sz.block_tokens
    return {"tiers": tiers, "hit_ratio": prev, "token_hit_ratio": hit_tokens / max(1, sz.input_tokens),
            "ttft_saved_ms": 1000 * (hit_tokens / tps - load_s) / max(1, sz.requests)}


def report(sz: Sizing, cfg: StackConfig, base: StackConfig, args, local, shared) -> dict:
    bb, u = cfg.block_bytes, sz.unique_blocks
    rep: dict[str, Any] = {
        "requests": sz.requests, "block_refs": sz.refs, "input_tokens": sz.input_tokens,
        "unique_blocks": u, "block_tokens": sz.block_tokens, "block_bytes": bb, "config": cfg.source,
        "method": {"kind": "lru stack distances" if sz.sample_rate >= 1 else "SHARDS sample",
                   "sample_rate": sz.sample_rate, "error": sz.error(), "resolution_blocks": sz.resolution(),
                   "sample_blocks": sz.sample_blocks, "exact_vs_replay": sz.exact, "not_prefix": sz.not_prefix,
                   "capped_rerefs": sz.capped_rerefs, "seconds": sz.seconds},
        "model": {"tiers": "inclusive lru: tier i holds the max(C_0..C_i) most recent blocks; a block hits the "
                           "topmost tier holding it",
                  "exact_when": "one tier; or a lower tier that never evicts (capacity >= the unique blocks) "
                                "or is no larger than the tier above, under write_through",
                  "demotion": cfg.policy.demotion,
                  "gpu": "vLLM's block pool (sized by vLLM): not modelled, as in replay"},
        "cost_model": {"prefill_tokens_per_s": args.prefill_tokens_per_s,
                       "prefill_source": getattr(args, "prefill_source", "--prefill-tokens-per-s"),
                       "load_gbps": {t.name: _gbps(args, t) for t, _ in local + ([shared] if shared else [])}},
        "warnings": []}
    if sz.sample_rate < 1 and sz.sample_blocks < MIN_SAMPLE_BLOCKS:
        rep["warnings"].append(f"the sample holds {sz.sample_blocks} blocks (< {MIN_SAMPLE_BLOCKS}): on skewed "
                               f"traffic its error can exceed the stated one; raise --sample")
    if sz.sample_rate >= 1 and not sz.exact:
        rep["warnings"].append(
            f"the curve models replay closely but not exactly: {sz.not_prefix} requests whose cached blocks are "
            f"not a prefix (ids not chained), {sz.capped_rerefs} re-sent block-aligned prompts (vLLM recomputes "
            f"their last block)")
    grid_caps = sorted({max(1, int(f * u)) for f in FRACTIONS} | {c for _, c in local if c})
    if args.instances > 1:
        rep["fleet"] = _fleet(sz, local, shared, args, bb)
        caps = np.array(grid_caps, dtype=np.float64)
    else:
        reach = _effective(local, shared, sz)
        now = _stack_point(sz, reach, args, bb)
        for t, (_, c) in zip(now["tiers"], local + ([shared] if shared else [])):
            t["capacity_blocks"] = c
            t["capacity_bytes"] = c * bb
        if cfg.policy.demotion == "write_back" and len(local) > 1:  # the exclusive bound for lower tiers
            excl = list(itertools.accumulate(local, lambda a, b: (b[0], a[1] + b[1])))
            hi = _stack_point(sz, excl + reach[len(local):], args, bb)
            for t, h in zip(now["tiers"][1:len(local)], hi["tiers"][1:len(local)]):
                t["hit_ratio_range"] = [t["hit_ratio"], h["hit_ratio"]]
            now["hit_ratio_range"] = [now["hit_ratio"], hi["hit_ratio"]]
        rep["stack"] = now
        rep["per_tier"] = _per_tier(sz, local, shared, args, bb, grid_caps)
        caps = np.array(sorted(set(grid_caps) | {c for _, c in reach}), dtype=np.float64)
    hr, se = sz.hit_ratio(caps), sz.stderr(caps)
    top = local[0][0] if local else None
    rep["curve"] = []
    for c, r, e in zip(caps, hr, se):
        p = {"capacity_blocks": int(c), "capacity_bytes": int(c) * bb, "hit_ratio": float(r),
             "token_hit_ratio": float(r) * sz.refs * sz.block_tokens / max(1, sz.input_tokens),
             "load_bytes": int(r * sz.refs * bb)}
        if top is not None:
            p["ttft_saved_ms"] = _stack_point(sz, [(top, int(c))], args, bb)["ttft_saved_ms"]
        if sz.sample_rate < 1:
            p["stderr"] = float(e)
            p["resolved"] = bool(c >= sz.resolution())
        rep["curve"].append(p)
    grid = capacity_grid(max(1, u), 64)
    grid = grid[grid >= sz.resolution()]
    rep["curve_log"] = [{"capacity_blocks": int(c), "hit_ratio": float(r),
                         "token_hit_ratio": float(r) * sz.refs * sz.block_tokens / max(1, sz.input_tokens)}
                        for c, r in zip(grid, sz.hit_ratio(grid))]
    if args.target_hit is not None or args.budget is not None:
        rep["suggestion"] = suggest(sz, base, cfg, local, shared, args, rep)
    return rep


def _per_tier(sz: Sizing, local, shared, args, bb: int, caps: list[int]) -> list[dict]:
    """Each tier's own curve: its capacity varied over `caps`, the other tiers as configured."""
    tiers = local + ([shared] if shared else [])
    out = []
    for i, (t, _) in enumerate(tiers):
        pts = []
        for c in caps:
            trial = [(tt, c if j == i else cc) for j, (tt, cc) in enumerate(tiers)]
            p = _stack_point(sz, _effective(trial[:len(local)], trial[len(local)] if shared else None, sz), args, bb)
            me = p["tiers"][i]
            pts.append({"capacity_blocks": c, "capacity_bytes": c * bb, "hit_ratio": me["hit_ratio"],
                        "token_hit_ratio": me["token_hit_ratio"], "load_bytes": me["load_bytes"],
                        "stack_hit_ratio": p["hit_ratio"], "ttft_saved_ms": p["ttft_saved_ms"]})
        out.append({"name": t.name, "kind": t.kind, "points": pts})
    return out


def _fleet(sz: Sizing, local, shared, args, bb: int) -> dict:
    """Fleet: each instance's local tiers at their configured size; what the shared tier adds by its size."""
    lc = sz.local_capacity
    local_hr = float(sz.hit_ratio([lc])[0]) if lc else 0.0
    u = sz.unique_blocks
    caps = sorted({max(1, int(f * u)) for f in FRACTIONS} | ({shared[1]} if shared and shared[1] else set()))
    add = sz.hit_ratio(caps, shared=True)
    conf = shared[1] if shared and shared[1] else u
    pts = [{"capacity_blocks": c, "capacity_bytes": c * bb, "added_hit_ratio": float(a),
            "fleet_hit_ratio": local_hr + float(a)} for c, a in zip(caps, add)]
    at = float(sz.hit_ratio([conf], shared=True)[0])
    return {"instances": sz.instances, "routing": sz.routing, "requests_per_instance": sz.per_instance_requests,
            "local_capacity_blocks": lc, "local_hit_ratio": local_hr,
            "shared": {"name": shared[0].name if shared else None, "capacity_blocks": shared[1] if shared else None,
                       "modelled_blocks": conf, "added_hit_ratio": at, "fleet_hit_ratio": local_hr + at,
                       "error": sz.error(shared=True)},
            "shared_curve": pts,
            "model": "each instance: an lru stack over the requests routed to it (local tiers, inclusive); the "
                     "shared tier: an lru stack over the blocks the instances miss locally, in arrival order"}


def _belady(reqs, sz: Sizing, configured: list[int], bt: int) -> tuple[list[dict], dict]:
    """Belady's MIN (ties deepest-first, replay's rules) at the configured reach and 1/5/10%: exact,
    or on a sample of the blocks of a large trace (`belady_points`, its error stated)."""
    u = sz.unique_blocks
    caps = sorted({max(1, int(f * u)) for f in BELADY_FRACTIONS} | {c for c in configured if c})
    lru = sz.hit_ratio(caps)
    got = belady_points(reqs, caps, bt, sz.refs)
    method = {k: got[k] for k in ("sample_rate", "error", "seconds")}
    return [{**p, "lru_hit_ratio": float(r)} for p, r in zip(got["points"], lru)], method


def _size_str(n: int) -> str:
    """Bytes as the largest exact unit a config takes ('12GiB', '768MiB')."""
    for unit, k in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n and n % (1 << k) == 0:
            return f"{n >> k}{unit}"
    return str(n)


def _round_mib(blocks: int, bb: int) -> int:
    return max(1, -(-blocks * bb // (1 << 20))) << 20


def _yaml(base: StackConfig, capacity: dict[str, int], head: str) -> str:
    """`base` as YAML with the tiers named in `capacity` resized (bytes); credentials are left out."""
    import yaml
    from kvtier.core.config import parse_config
    from kvtier.tiers.redact import redact
    keep = ("name", "kind", "capacity", "capacity_blocks", "path", "io", "url", "cluster", "eviction", "admission")
    lines = [f"# {head}", f"block_bytes: {_size_str(base.block_bytes)}"]
    if base.block_tokens != 512:
        lines.append(f"block_tokens: {base.block_tokens}")
    lines.append("tiers:")
    for t in base.tiers:
        d = {k: v for k, v in t.model_dump(exclude_defaults=True).items() if k in keep}
        d["name"], d["kind"] = t.name, t.kind
        if t.name in capacity:
            d.pop("capacity_blocks", None)
            d["capacity"] = capacity[t.name]
        if isinstance(d.get("capacity"), int):
            d["capacity"] = _size_str(d["capacity"])
        if "url" in d and redact(d["url"]) != d["url"]:   # a password: not copied (the URL from the environment)
            d["url"] = f"${{KVTIER_REDIS_URL:-{redact(d['url'])}}}"
        lines.append("  - " + yaml.safe_dump(d, default_flow_style=True, sort_keys=False).strip())
    pol = {k: v for k, v in base.policy.model_dump().items() if k != "params" or v}
    lines.append("policy: " + yaml.safe_dump(pol, default_flow_style=True, sort_keys=False).strip())
    out = "\n".join(lines) + "\n"
    parse_config(yaml.safe_load(out), source="<suggested yaml>", check_env=False)  # loadable, or a bug
    return out


def suggest(sz: Sizing, base: StackConfig, cfg: StackConfig, local, shared, args, rep: dict) -> dict:
    """--target-hit R: the smallest capacity reaching R; the lowest local tier gets it (inclusive model),
    the top tier keeps its size (or gets it, if it is the only one or already larger). --budget SIZE:
    the top local tier gets SIZE of DRAM. Fleet mode: both size the shared tier instead."""
    bb = cfg.block_bytes
    u = sz.unique_blocks
    fleet = sz.instances > 1
    base_hr = rep["fleet"]["local_hit_ratio"] if fleet else 0.0

    def hr(c: int) -> float:
        return base_hr + float(sz.hit_ratio([c], shared=fleet)[0])
    if args.target_hit is not None:
        r = _target(args.target_hit)
        goal = f"target {_pct(r)} block hits"
        if hr(u) < r:
            raise ConfigError(f"--target-hit {args.target_hit}: no capacity reaches it: this trace's reuse tops out "
                              f"at {_pct(hr(u))} block hits{' for this fleet' if fleet else ''} (every block kept)")
        lo, hi = 1, u
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if hr(mid) >= r else (mid + 1, hi)
        need = lo
    else:
        need = max(1, parse_size(args.budget) // bb)
        goal = f"budget {format_size(need * bb)} of {'shared tier' if fleet else 'DRAM'}"
    sizes: dict[str, int] = {}
    if fleet:
        if args.target_hit is not None and base_hr >= _target(args.target_hit):
            summary = f"the instances' local tiers alone reach it ({_pct(base_hr)}); no shared tier needed"
        else:
            name = shared[0].name if shared else "shared"
            sizes[name] = _round_mib(need, bb)
            summary = (f"a shared tier of {format_size(sizes[name])} ({need} blocks): {_pct(hr(need))} fleet block "
                       f"hits (local {_pct(base_hr)})")
        if shared:
            yaml_text = _yaml(base, sizes, f"kvtier plan, {goal}: {summary}")
        else:
            yaml_text = (f"# {summary}\n# add a shared tier below the local tiers of your stack:\n"
                         f"#   - {{name: shared, kind: shared, url: 'redis://HOST:6379/0', "
                         f"capacity: {_size_str(sizes.get('shared', 0))}}}\n")
    else:
        top, top_c = local[0]
        if args.budget is not None or len(local) == 1 or top_c >= need:
            sizes[top.name] = _round_mib(need, bb)
        else:
            low = local[-1][0]
            sizes[low.name] = _round_mib(need, bb)
        got = {t.name: (sizes[t.name] // bb if t.name in sizes else c) for t, c in local}
        reach = _effective([(t, got[t.name]) for t, _ in local], shared, sz)
        pt = _stack_point(sz, reach, args, bb)
        summary = (", ".join(f"{n} {format_size(b)}" for n, b in sizes.items())
                   + f": {_pct(pt['hit_ratio'])} block hits, TTFT saved {pt['ttft_saved_ms']:.1f} ms per request")
        yaml_text = _yaml(base, sizes, f"kvtier plan, {goal}: {summary} (inclusive lru model)")
    return {"goal": goal, "capacity_blocks": need, "capacity_bytes": {n: b for n, b in sizes.items()},
            "hit_ratio": hr(need), "summary": summary, "yaml": yaml_text}


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def text(rep: dict) -> str:
    m = rep["method"]
    bb = rep["block_bytes"]
    lines = [f"plan: {rep['requests']} requests, {rep['block_refs']} block refs, {rep['unique_blocks']} unique "
             f"full blocks of {rep['block_tokens']} tokens ({format_size(bb)} each) from {rep['trace']}"]
    if m["kind"] == "SHARDS sample":
        lines.append(f"  method: SHARDS sample at rate {m['sample_rate']:g} ({m['sample_blocks']} blocks), error "
                     f"+/-{_pct(m['error'])} of hit ratio, capacities >= {m['resolution_blocks']} blocks; "
                     f"{m['seconds']:.2f} s")
    else:
        same = "equals `kvtier replay` with one lru tier at every capacity" if m["exact_vs_replay"] else \
            "a close model of replay (see the warning)"
        lines.append(f"  method: lru stack distances, exact ({same}); {m['seconds']:.2f} s")
    if rep.get("geometry_note"):
        lines.append(f"  geometry: {rep['geometry_note']}")
    for w in rep["warnings"]:
        lines.append(f"  warning: {w}")
    if "stack" in rep:
        st = rep["stack"]
        lines.append(f"  stack {rep['config']}, {rep['model']['demotion']} (model: inclusive lru; gpu: vLLM's pool)")
        for t in st["tiers"]:
            rng = f" (write-back: up to {_pct(t['hit_ratio_range'][1])})" if "hit_ratio_range" in t else ""
            size = f"{t['capacity_blocks']:>8} blocks ({format_size(t['capacity_bytes'])})" \
                if t["capacity_blocks"] else "unbounded (the server's memory)"
            lines.append(f"    {t['name']:<6} {t['kind']:<5} {size}: block hits {_pct(t['hit_ratio'])}{rng}, "
                         f"token hits {_pct(t['token_hit_ratio'])}, loads {format_size(t['load_bytes'])}")
        lines.append(f"    total: block hits {_pct(st['hit_ratio'])}, token hits {_pct(st['token_hit_ratio'])}, "
                     f"TTFT saved {st['ttft_saved_ms']:.1f} ms per request")
    if "fleet" in rep:
        f = rep["fleet"]
        s = f["shared"]
        lines.append(f"  fleet: {f['instances']} instances, {f['routing']} routing, local tiers of "
                     f"{f['local_capacity_blocks']} blocks each: {_pct(f['local_hit_ratio'])} block hits locally")
        lines.append(f"    shared tier {s['name'] or '(none configured)'} at {s['modelled_blocks']} blocks adds "
                     f"{_pct(s['added_hit_ratio'])} -> {_pct(s['fleet_hit_ratio'])}")
        lines.append(f"    {'shared capacity':>24}  {'adds':>8}  {'fleet':>8}")
        for p in f["shared_curve"]:
            lines.append(f"    {p['capacity_blocks']:>9} ({format_size(p['capacity_bytes']):>11})  "
                         f"{_pct(p['added_hit_ratio']):>8}  {_pct(p['fleet_hit_ratio']):>8}")
    bel = {b["capacity_blocks"]: b["hit_ratio"] for b in rep.get("belady", [])}
    lines.append(f"  one lru tier of C blocks{' (per instance)' if 'fleet' in rep else ''}:")
    lines.append(f"    {'capacity':>24}  {'block hit':>9}  {'token hit':>9}  {'TTFT saved':>10}"
                 + (f"  {'Belady':>7}" if bel else ""))
    for p in rep["curve"]:
        c = p["capacity_blocks"]
        if p.get("resolved") is False:
            lines.append(f"    {c:>9} ({format_size(p['capacity_bytes']):>11})  not resolved by the sample")
            continue
        lines.append(f"    {c:>9} ({format_size(p['capacity_bytes']):>11})  {_pct(p['hit_ratio']):>9}  "
                     f"{_pct(p['token_hit_ratio']):>9}  {p.get('ttft_saved_ms', 0):>7.1f} ms"
                     + (f"  {_pct(bel[c]) if c in bel else '':>7}" if bel else ""))
    rest = [b for b in rep.get("belady", []) if b["capacity_blocks"] not in {p["capacity_blocks"] for p in rep["curve"]}]
    for b in rest:
        lines.append(f"    Belady (MIN) at {b['capacity_blocks']} blocks: {_pct(b['hit_ratio'])} "
                     f"(lru {_pct(b['lru_hit_ratio'])})")
    bm = rep.get("belady_method")
    if bm and bm["sample_rate"] < 1:
        lines.append(f"    Belady on a sample of the blocks at rate {bm['sample_rate']:.3g}: error +/-{_pct(bm['error'])} "
                     f"of hit ratio ({bm['seconds']:.1f} s)")
    if "tenants" in rep:
        from kvtier.offline.tenant_plan import tenant_lines
        lines.extend(tenant_lines(rep["tenants"], rep["stack"]["tiers"][0]["name"] if rep.get("stack") else None, bb))
    if "suggestion" in rep:
        s = rep["suggestion"]
        lines.append(f"  suggestion ({s['goal']}): {s['summary']}")
        lines.extend("    " + ln for ln in s["yaml"].rstrip().splitlines())
    if "png" in rep:
        lines.append(f"  plot: {rep['png']}")
    return "\n".join(lines)
