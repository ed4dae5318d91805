"""The CLI commands: spill, restore, inspect, bench (and the offline operations behind them)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from .blockgen import block_key, fill_block
from .config import ConfigError, load_config
from .stack import TierStack
from .units import format_size

MANIFEST = "spill-manifest.json"


def _progress(args: argparse.Namespace, total: int, desc: str):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="blk", disable=args.quiet or args.json or None,
                file=sys.stderr, dynamic_ncols=True)


def _nvme_index(stack: TierStack) -> int:
    for i, t in enumerate(stack.tiers):
        if t.kind == "nvme":
            return i
    raise ConfigError(f"{stack.cfg.source}: tiers: spill/restore need an nvme tier")


def _staging(num: int, block_bytes: int):
    from kvtier.tiers.cpu_pool import CpuPool
    return CpuPool(num, block_bytes, pin="auto")


# ---- spill ------------------------------------------------------------------------------
def cmd_spill(args: argparse.Namespace) -> int:
    if args.blocks <= 0:
        raise ValueError(f"--blocks must be > 0, got {args.blocks}")
    cfg = load_config(args.config)
    stack = TierStack.from_config(cfg)
    try:
        r = spill(stack, args.blocks, args.seed, args.batch, args)
    finally:
        stack.close()
    _print(args, r, lambda d: (
        f"spilled {d['blocks']} blocks ({format_size(d['bytes'])}) to {d['tier']} in {d['seconds']:.2f} s: "
        f"{d['gbps']:.2f} GB/s of stack I/O (data generation {d['gen_seconds']:.2f} s excluded); "
        f"engine: {d['engine']}; on nvme: {d['nvme_resident']}"))
    return 0


def spill(stack: TierStack, n: int, seed: int, batch: int, args: Any = None) -> dict:
    ni = _nvme_index(stack)
    nvme = stack.tiers[ni]
    bb = stack.block_bytes
    batch = max(1, min(batch, n))
    staging = _staging(batch, bb)
    log_f = open(args.commit_log, "a") if args is not None and getattr(args, "commit_log", None) else None
    bar = _progress(args, n, "spill") if args is not None else None
    gen_s = io_s = 0.0
    durable = logged = 0
    try:
        for lo in range(0, n, batch):
            hi = min(n, lo + batch)
            t0 = time.perf_counter()
            for j in range(lo, hi):
                fill_block(staging.views[j - lo], seed, j)
            t1 = time.perf_counter()
            stack.put([block_key(seed, j) for j in range(lo, hi)], staging.views[: hi - lo])
            if ni > 0 and hi == n:
                for ti in range(ni):
                    stack.flush(ti)
            io_s += time.perf_counter() - t1
            gen_s += t1 - t0
            durable = _advance(durable, hi, nvme, seed)
            if log_f and durable > logged:
                logged = durable
                log_f.write(f"{durable - 1}\n")  # blocks 0..durable-1 are all committed on NVMe
                log_f.flush()
                os.fsync(log_f.fileno())
            if bar is not None:
                bar.update(hi - lo)
    finally:
        if bar is not None:
            bar.close()
        if log_f:
            log_f.close()
        staging.close()
    present = sum(1 for j in range(n) if block_key(seed, j) in nvme)
    manifest = {"seed": seed, "blocks": n, "block_bytes": bb, "on_nvme": present}
    _write_manifest(nvme.path, manifest)
    return {"blocks": n, "bytes": n * bb, "seconds": io_s, "gen_seconds": gen_s,
            "gbps": n * bb / io_s / 1e9 if io_s else 0.0, "engine": _engine(nvme), "tier": nvme.name,
            "nvme_resident": present, "evicted_from_nvme": n - present, "seed": seed,
            "metrics": stack.metrics.as_dict()}


def _advance(durable: int, hi: int, nvme: Any, seed: int) -> int:
    """First index >= durable whose block is not yet on NVMe (everything before it is)."""
    while durable < hi and block_key(seed, durable) in nvme:
        durable += 1
    return durable


def _write_manifest(path: str, manifest: dict) -> None:
    p = Path(path) / MANIFEST
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest))
    os.replace(tmp, p)


def _engine(tier: Any) -> str:
    return getattr(tier, "io_engine", None) or tier.stats().get("engine", "?")


# ---- restore ----------------------------------------------------------------------------
def cmd_restore(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    stack = TierStack.from_config(cfg)
    try:
        r = restore(stack, args.seed, args.verify, args)
    finally:
        stack.close()
    _print(args, r, lambda d: (
        f"restored {d['restored']} blocks ({format_size(d['bytes'])}) in {d['seconds']:.2f} s: {d['gbps']:.2f} GB/s; "
        f"corrupt (detected, not served): {d['corrupt']}; missing: {d['missing']}; "
        f"content mismatches served as good: {d['bad_served']}" + ("" if d["verified"] else " (contents not compared: no seed)")
        + f"; engine: {d['engine']}"))
    if r["bad_served"]:
        return 3
    if args.strict and (r["corrupt"] or r["missing"]):
        return 1
    return 0


def restore(stack: TierStack, seed: int | None, verify: bool, args: Any = None, batch: int = 64) -> dict:
    import torch

    ni = _nvme_index(stack)
    nvme = stack.tiers[ni]
    bb = stack.block_bytes
    manifest = _read_manifest(nvme.path)
    if seed is None and manifest:
        seed = manifest.get("seed")
    entries = sorted(((s, k) for k, s in nvme._slot_of.items()))
    staging = _staging(batch, bb)
    expect = staging_expect = None
    if verify and seed is not None:
        staging_expect = _staging(1, bb)
        expect = staging_expect.views[0]
    restored = corrupt = bad = other = 0
    bar = _progress(args, len(entries), "restore") if args is not None else None
    t_io = 0.0
    try:
        for lo in range(0, len(entries), batch):
            chunk = entries[lo:lo + batch]
            slots = [s for s, _ in chunk]
            t0 = time.perf_counter()
            res = nvme.read(slots, staging.views[:len(chunk)]).wait()
            t_io += time.perf_counter() - t0
            for j, ((s, k), ok) in enumerate(zip(chunk, res.ok)):
                if not ok:
                    corrupt += 1
                    continue
                restored += 1
                if expect is not None:
                    idx = _index_of(k, seed)
                    if idx is None:  # written by another spill or by a server: checksum only
                        other += 1
                        continue
                    fill_block(expect, seed, idx)
                    if not torch.equal(staging.views[j], expect):
                        bad += 1
            if bar is not None:
                bar.update(len(chunk))
    finally:
        if bar is not None:
            bar.close()
        staging.close()
        if staging_expect is not None:
            staging_expect.close()
    expected = manifest.get("on_nvme") if manifest else None
    missing = max(0, expected - len(entries)) if expected is not None else 0
    return {"restored": restored, "corrupt": corrupt, "missing": missing, "bad_served": bad,
            "index_entries": len(entries), "not_compared": other, "bytes": restored * bb, "seconds": t_io,
            "gbps": restored * bb / t_io / 1e9 if t_io else 0.0, "verified": expect is not None,
            "seed": seed, "engine": _engine(nvme), "tier": nvme.name}


def _index_of(key: bytes, seed: int) -> int | None:
    """Inverse of block_key for this seed (None for a key from another seed or source)."""
    from .keys import split_key
    h, _ = split_key(key)
    v = int.from_bytes(h, "big")
    if (v >> 32) != (seed & 0xFFFFFFFF):
        return None
    return v & 0xFFFFFFFF


def _read_manifest(path: str) -> dict | None:
    p = Path(path) / MANIFEST
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{p}: unreadable spill manifest: {e}") from None


# ---- inspect ----------------------------------------------------------------------------
def cmd_inspect(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    stack = TierStack.from_config(cfg)
    try:
        st = stack.stats()
    finally:
        stack.close()
    st["config"] = cfg.source

    def text(d: dict) -> str:
        lines = [f"config: {d['config']}  block_bytes: {d['block_bytes']}  policies: {d['policies']}"]
        for t in d["tiers"]:
            lines.append(f"  {t['name']:<8} {t['kind']:<5} {t['resident_blocks']:>9} / {t['capacity_blocks']:<9} blocks "
                         f"({100 * t['occupancy']:.1f}%)  eviction={t['eviction']}  engine={t.get('engine', '-')}")
            for k in ("path", "fingerprint", "corrupt_blocks"):
                if k in t:
                    lines.append(f"           {k}: {t[k]}")
        return "\n".join(lines)

    _print(args, st, text)
    return 0


# ---- bench ------------------------------------------------------------------------------
def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import run_bench
    r = run_bench(args)
    _print(args, r, _bench_text)
    return 0


def _bench_text(d: dict) -> str:
    lines = [f"kvtier bench (median of {d['repeat']}, {format_size(d['total_bytes'])} per run)",
             f"{'what':<22}{'block':>10}{'ours GB/s':>12}{'limit GB/s':>12}{'ratio':>8}  limit"]
    for row in d["rows"]:
        lines.append(f"{row['what']:<22}{format_size(row['block_bytes']):>10}{row['ours_gbps']:>12.2f}"
                     f"{row['limit_gbps']:>12.2f}{row['ratio']:>8.2f}  {row['limit']}")
    for note in d.get("notes", []):
        lines.append(f"note: {note}")
    return "\n".join(lines)


def _print(args: argparse.Namespace, result: dict, text) -> None:
    if args is not None and getattr(args, "json", False):
        print(json.dumps(result, default=str))
    else:
        print(text(result))
