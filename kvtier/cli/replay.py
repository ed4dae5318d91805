"""`kvtier replay`: a trace through the real stack (`kvtier.offline.replay`), with Belady's MIN at
the same capacity and a TTFT cost model; `--compare` sets the eviction policies side by side."""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Sequence

from kvtier.core.config import ConfigError, StackConfig, load_config, parse_config
from kvtier.core.fit import check_environment, fit_to_machine
from kvtier.core.stack import TierStack
from kvtier.offline.replay import DEFAULT_LOAD_GBPS, DEFAULT_PREFILL_TPS, replay
from kvtier.offline.trace import BLOCK_TOKENS, apply_geometry, default_trace
from kvtier.common.units import format_size


def add_parser(sub) -> None:
    p = sub.add_parser("replay", help="replay a Mooncake-format trace through the stack (the main job)")
    p.add_argument("--trace", default=None, help="Mooncake JSONL (default: the bundled conversation trace)")
    p.add_argument("--config", "-c", default=None, help="YAML tier stack (default: the embedded cpu-nvme)")
    p.add_argument("--policy", default=None, help="eviction policy for every tier (overrides the config)")
    p.add_argument("--admission", default=None, help="admission policy for every tier (overrides the config)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--capacity-fraction", type=float, default=None,
                   help="single-tier stack of F x the trace's unique blocks")
    g.add_argument("--capacity-blocks", type=int, default=None, help="single-tier stack of N blocks")
    p.add_argument("--no-data", action="store_true", help="metadata only: no bytes move")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--prefill-tokens-per-s", type=float, default=DEFAULT_PREFILL_TPS,
                   help=f"cost model: prefill speed of the served model (default {DEFAULT_PREFILL_TPS:.0f})")
    p.add_argument("--load-gbps", default=None,
                   help="cost model: per-tier load bandwidth, e.g. 'cpu=20,nvme=5' (default by tier kind)")
    p.add_argument("--warm", action="store_true",
                   help="keep what persistent tiers hold from an earlier run (default: start cold, like Belady)")
    p.add_argument("--no-belady", action="store_true", help="skip the Belady yardstick")
    p.add_argument("--no-tenants", action="store_true", help="ignore the config's tenants: quotas (to compare)")
    p.add_argument("--plot", default=None, help="PNG: hit ratio vs capacity for the policies")
    p.add_argument("--compare", action="store_true",
                   help="metadata-only: the default eviction next to vllm_lru, lru, arc, s3fifo and Belady "
                        "(block and token hit ratios, at the given capacity or 1/5/10%%)")
    p.add_argument("--trust-block-tokens", action="store_true",
                   help="take the trace's block size as given even when its input lengths contradict it")
    p.add_argument("--json", action="store_true")
    p.add_argument("--quiet", "-q", action="store_true")


def run(args: argparse.Namespace) -> int:
    from kvtier.offline.trace import load_trace, unique_blocks

    trace = Path(args.trace) if args.trace else default_trace()
    if trace.is_dir():
        raise ConfigError(f"--trace: {trace}: is a directory, not a trace file [EISDIR]")
    if not trace.is_file():
        raise ConfigError(f"--trace: {trace}: no such file (set KVTIER_TRACE or pass --trace)")
    _check_args(args)
    reqs = load_trace(trace, limit=args.limit, trust_block_tokens=getattr(args, "trust_block_tokens", False))
    if not reqs:
        raise ConfigError(f"--trace: {trace}: no requests in the trace (empty, or only blank lines)")
    for w in reqs.warnings:
        print(f"replay: warning: {w}", file=sys.stderr)
    if args.compare:
        from kvtier.offline.compare import run_compare
        return run_compare(args, reqs, trace)
    bt = reqs.block_tokens
    cfg = _stack_config(args, unique_blocks(reqs), bt, reqs.geometry)
    if not args.no_data:  # the tiers are allocated: they must fit this machine's memory and disk
        check_environment(cfg)
    scratch = _Scratch(cfg, use=not args.no_data and not args.warm)
    try:
        cfg = fit_to_machine(scratch.cfg, check=not args.no_data)[0]
        if args.no_data:
            _check_metadata_memory(cfg)
        with TierStack.from_config(cfg, with_data=not args.no_data) as stack:
            held = {t.name: t.num_resident for t in stack.tiers if t.num_resident}
            if held and not args.warm:  # a replay is measured from empty tiers, as Belady is
                stack.clear()
                print(f"replay: starting cold: dropped the blocks an earlier run left in "
                      f"{', '.join(f'{k} ({v})' for k, v in held.items())}; --warm keeps them", file=sys.stderr)
            res = replay(stack, reqs, progress=not (args.quiet or args.json))
            res["start"] = {"warm": bool(args.warm), "blocks_held_at_open": held}
    finally:
        res_data = scratch.close()
    if not args.no_data:
        res["nvme_data"] = res_data
        for line in scratch.lines():
            print(line, file=sys.stderr)
    res["trace"] = str(trace)
    res["config"] = cfg.source
    res["block_tokens"] = bt
    cap = sum(t.capacity_blocks for t in stack.tiers)
    if not args.no_belady:  # under the rules replay serves by (full blocks, one token left)
        from kvtier.offline.belady import belady
        res["belady_hit_ratio"] = belady(reqs, cap, bt, vllm=True)["hit_ratio"]
    res["cost"] = cost_model(res, stack, args)
    if args.plot:
        res["plot"] = plot(reqs, args.plot, cfg.policy.eviction, bt)
    if args.json:
        import json
        print(json.dumps(res, default=str))
    else:
        print(_text(res))
    return 0


META_BYTES_PER_BLOCK = 256   # a metadata-only tier's per-slot arrays and index entry (about 85 B + 170 B)


def _check_metadata_memory(cfg: StackConfig) -> None:
    """A metadata-only replay allocates no blocks, but each slot of capacity still costs memory."""
    from kvtier.core.fit import available_memory, memory_headroom
    tiers = [t for t in cfg.storage_tiers() if t.kind in ("cpu", "nvme") or t.capacity is not None
             or t.capacity_blocks is not None]
    n = sum(t.blocks(cfg.block_bytes) for t in tiers)
    room = available_memory() - memory_headroom()
    if n * META_BYTES_PER_BLOCK > room:
        big = max(tiers, key=lambda t: t.blocks(cfg.block_bytes))
        names = ", ".join(t.name for t in tiers)
        raise ConfigError(f"{cfg.source}: tiers.{cfg.tiers.index(big)}.capacity: --no-data still keeps about "
                          f"{META_BYTES_PER_BLOCK} B per block of capacity: {n} blocks ({names}) need "
                          f"{format_size(n * META_BYTES_PER_BLOCK)} of memory, only {format_size(max(0, room))} "
                          f"available (MemAvailable less headroom); tier {big.name!r} is the largest")


class _Scratch:
    """Where a replay's NVMe tiers keep their files. Cold (the default), each runs in a scratch
    directory inside its configured path (so on that file system), removed at the end: a replay
    leaves no data behind and never touches blocks a spill or a server left there. `--warm` runs
    in the configured path itself and keeps what it wrote (for the next --warm run)."""

    PREFIX = "replay-scratch-"

    def __init__(self, cfg: StackConfig, use: bool) -> None:
        self.made: list[tuple[str, str, list[str]]] = []   # (tier, scratch dir, directories created for it)
        self.kept: list[tuple[str, str]] = []
        self.report: dict[str, dict] = {}
        tiers = []
        for t in cfg.tiers:
            if t.kind == "nvme" and use:
                from kvtier.tiers.nvme_dir import claim_dir
                created, p = [], os.path.abspath(t.path)
                while not os.path.lexists(p):
                    created.append(p)
                    p = os.path.dirname(p)
                os.close(claim_dir(t.path))  # kvtier's own (or new): never scratch in someone else's
                _remove_stale(t.path)
                d = os.path.join(t.path, f"{self.PREFIX}{os.getpid()}")
                shutil.rmtree(d, ignore_errors=True)
                self.made.append((t.name, d, created))
                t = t.model_copy(update={"path": d})
            elif t.kind == "nvme":
                self.kept.append((t.name, t.path))
            tiers.append(t)
        self.cfg = cfg.model_copy(update={"tiers": tiers})

    def close(self) -> dict:
        from kvtier.tiers.nvme_dir import MARKER_FILE
        for name, d, created in self.made:
            self.report[name] = {"path": d, "bytes_on_disk": _du(d), "removed": True}
            shutil.rmtree(d, ignore_errors=True)
            for i, p in enumerate(created):   # deepest first; only while empty (but for our marker)
                try:
                    if i == 0 and os.listdir(p) == [MARKER_FILE]:
                        os.unlink(os.path.join(p, MARKER_FILE))
                    os.rmdir(p)
                except OSError:
                    break
        for name, d in self.kept:
            self.report[name] = {"path": d, "bytes_on_disk": _du(d), "removed": False}
        return self.report

    def lines(self) -> list[str]:
        out = []
        for name, r in self.report.items():
            if r["removed"]:
                out.append(f"replay: nvme tier {name!r} ran in the scratch directory {r['path']} "
                           f"({format_size(r['bytes_on_disk'])} on disk), now removed; --warm runs in "
                           f"{os.path.dirname(r['path'])} itself and keeps its blocks")
            else:
                out.append(f"replay: nvme tier {name!r} keeps {format_size(r['bytes_on_disk'])} on disk in "
                           f"{r['path']} (--warm); remove that directory to free it")
        return out


def _du(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_blocks * 512
            except OSError:
                pass
    return total


def _remove_stale(path: str) -> None:
    """Scratch directories of replays that were killed (their pid is gone)."""
    try:
        names = os.listdir(path)
    except OSError:
        return
    for n in names:
        pid = n[len(_Scratch.PREFIX):] if n.startswith(_Scratch.PREFIX) else ""
        if pid.isdigit() and int(pid) != os.getpid() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(os.path.join(path, n), ignore_errors=True)


def _stack_config(args: argparse.Namespace, unique: int, block_tokens: int = BLOCK_TOKENS,
                  geometry: dict | None = None) -> StackConfig:
    base, note = apply_geometry(load_config(args.config, check_env=False), block_tokens, geometry)
    if note:   # the trace's blocks are the unit: its recorded geometry, else the config's bytes per token
        print(f"replay: {note}", file=sys.stderr)
    data = base.model_dump(exclude={"source"})
    if args.capacity_fraction is not None or args.capacity_blocks is not None:   # checked by _check_args
        n = args.capacity_blocks if args.capacity_blocks is not None else max(1, int(args.capacity_fraction * unique))
        data["tiers"] = [{"name": "cpu", "kind": "cpu", "capacity_blocks": n}]
    else:
        for t in data["tiers"]:  # keep capacity_blocks or capacity, not both (dump has both keys)
            if t.get("capacity_blocks") is not None:
                t["capacity"] = None
    if args.policy:
        data["policy"]["eviction"] = args.policy
        for t in data["tiers"]:
            t["eviction"] = None
    if getattr(args, "no_tenants", False):
        data["tenants"] = None
    if args.admission:
        data["policy"]["admission"] = args.admission
        for t in data["tiers"]:
            t["admission"] = None
    changed = data != base.model_dump(exclude={"source"})
    return parse_config(data, source=base.source + (" (replay overrides)" if changed else ""), check_env=False)


def load_gbps(args: argparse.Namespace) -> dict[str, float]:
    """--load-gbps 'NAME=GBPS,...' -> {name: GB/s}; each a finite number > 0."""
    out: dict[str, float] = {}
    if getattr(args, "load_gbps", None):
        for part in str(args.load_gbps).split(","):
            name, _, v = part.partition("=")
            try:
                x = float(v)
            except ValueError:
                raise ConfigError(f"--load-gbps: {part!r} is not NAME=GBPS") from None
            if not (x > 0 and math.isfinite(x)):
                raise ConfigError(f"--load-gbps: {part!r}: the bandwidth must be a finite number > 0")
            out[name.strip()] = x
    return out


def _check_args(args: argparse.Namespace) -> None:
    """Every numeric argument, before any work: one line naming the first bad one."""
    if args.limit is not None and args.limit <= 0:
        raise ConfigError(f"--limit must be > 0, got {args.limit}")
    if args.capacity_blocks is not None and args.capacity_blocks <= 0:
        raise ConfigError(f"--capacity-blocks must be > 0, got {args.capacity_blocks}")
    if args.capacity_fraction is not None and not (args.capacity_fraction > 0 and math.isfinite(args.capacity_fraction)):
        raise ConfigError(f"--capacity-fraction must be > 0, got {args.capacity_fraction}")
    tps = getattr(args, "prefill_tokens_per_s", DEFAULT_PREFILL_TPS)
    if not (tps > 0 and math.isfinite(tps)):
        raise ConfigError(f"--prefill-tokens-per-s must be a finite number > 0, got {tps}")
    load_gbps(args)


def cost_model(res: dict, stack: TierStack, args: argparse.Namespace) -> dict:
    """TTFT saved: prefill time of the hit tokens minus the time to load their bytes per tier."""
    gbps = dict(DEFAULT_LOAD_GBPS)
    by_name = load_gbps(args)
    tps = float(getattr(args, "prefill_tokens_per_s", DEFAULT_PREFILL_TPS))
    bb = stack.block_bytes
    saved = load = 0.0
    tiers = []
    for t in res["per_tier"]:
        bw = by_name.get(t["name"], by_name.get(t["kind"], gbps.get(t["kind"], 5.0)))
        tl = t["hit_blocks"] * bb / (bw * 1e9)
        load += tl
        tiers.append({"name": t["name"], "load_gbps": bw, "load_s": tl})
    saved = res["hit_tokens"] / tps
    n = max(1, res["requests"])
    return {"prefill_tokens_per_s": tps, "prefill_s_without_cache": res["input_tokens"] / tps,
            "prefill_s_saved": saved, "load_s": load, "net_s_saved": saved - load,
            "mean_ttft_saved_ms": 1000 * (saved - load) / n, "tiers": tiers}


def plot(reqs: Sequence[Any], path: str, current: str, block_tokens: int = BLOCK_TOKENS) -> str:
    """Hit ratio vs single-tier capacity for every eviction policy, LRU and Belady."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvtier.policies import EVICTION
    from kvtier.offline.belady import belady
    from kvtier.offline.sim import simulate
    from kvtier.offline.trace import make_keys
    from kvtier.offline.trace import unique_blocks

    u = unique_blocks(reqs)
    fracs = [0.01, 0.02, 0.05, 0.1, 0.25]
    keys = make_keys(reqs)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in EVICTION.names():
        ys = [simulate(reqs, max(1, int(f * u)), name, keys=keys, block_tokens=block_tokens)["hit_ratio"]
              for f in fracs]
        ax.plot([100 * f for f in fracs], [100 * y for y in ys], marker="o", label=name,
                linewidth=2.5 if name == current else 1.2)
    ys = [belady(reqs, max(1, int(f * u)), block_tokens)["hit_ratio"] for f in fracs]
    ax.plot([100 * f for f in fracs], [100 * y for y in ys], "k--", label="Belady (MIN)")
    ax.set_xscale("log")
    ax.set_xlabel("capacity (% of unique blocks)")
    ax.set_ylabel("block hit ratio (%)")
    ax.set_title(f"{len(reqs)} requests, {u} unique blocks")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _text(d: dict) -> str:
    lines = [f"replayed {d['requests']} requests ({d['block_refs']} block refs) from {d['trace']}",
             f"  stack: {d['config']}; policies: {d['policies']}; "
             + (f"real bytes ({format_size(d['block_bytes'])} blocks)" if d["data"] else "metadata only"),
             f"  block hit ratio {100 * d['hit_ratio']:.2f}%   token hit ratio {100 * d['token_hit_ratio']:.2f}%"
             + (f"   Belady (MIN) at the same capacity {100 * d['belady_hit_ratio']:.2f}%" if "belady_hit_ratio" in d else "")]
    for t in d["per_tier"]:
        lines.append(f"  {t['name']:<6} {t['kind']:<5} cap {t['capacity_blocks']:>7}  hits {100 * t['hit_ratio']:6.2f}%  "
                     f"promoted in {t['promoted_in']:>6}  demoted in {t['demoted_in']:>6}  evicted {t['evicted']:>7}  "
                     f"read {format_size(t['bytes_read'])}  written {format_size(t['bytes_written'])}"
                     + (f"  corrupt {t['corrupt']}" if t["corrupt"] else ""))
    c = d["cost"]
    lines.append(f"  TTFT model ({c['prefill_tokens_per_s']:.0f} prefill tok/s): prefill {c['prefill_s_without_cache']:.1f} s "
                 f"without cache, {c['prefill_s_saved']:.1f} s saved, {c['load_s']:.1f} s loading -> "
                 f"{c['mean_ttft_saved_ms']:.1f} ms saved per request")
    for name, t in d.get("tenants", {}).items():
        held = "  ".join(f"{tn} held {v.get('held_blocks', 0)}/{v.get('quota_blocks', 0)} quota "
                         f"stored {v.get('stored', 0)} evicted {v.get('evicted', 0)}" for tn, v in t["tiers"].items())
        lines.append(f"  tenant {name:<10} block hit ratio {100 * t['hit_ratio']:6.2f}%  token hit ratio "
                     f"{100 * t['token_hit_ratio']:6.2f}%  ({t['block_refs']} block refs)" + (f"  {held}" if held else ""))
    if d["data"]:
        lines.append(f"  content check: {d['content_mismatches']} mismatches")
    lines.append(f"  {d['blocks_per_s'] / 1e3:.0f}k blocks/s ({d['seconds']:.2f} s)")
    if "plot" in d:
        lines.append(f"  plot: {d['plot']}")
    return "\n".join(lines)
