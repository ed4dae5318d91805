"""`kvtier inspect` (what each tier holds, read-only) and `kvtier fsck` (the NVMe tier's index
checked against its block headers, `--rebuild` to rebuild it)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from kvtier.cli.common import CommandFailed, load_fitted, nvme_tier_config, open_nvme_read_only, print_result
from kvtier.core.config import ConfigError, StackConfig
from kvtier.common.units import format_size


def cmd_inspect(args: argparse.Namespace) -> int:
    """What each tier holds; the NVMe tier read-only (no lock, nothing allocated), so it works
    on a live server's directory. `--watch S` refreshes every S seconds until Ctrl-C."""
    server = getattr(args, "server", None)
    cfg = load_fitted(args.config, allocate=False) if server is None else None
    watch = getattr(args, "watch", None)
    if watch is not None and not 0.1 <= watch <= 3600:
        raise ValueError(f"--watch must be between 0.1 and 3600 seconds, got {watch}")
    count = getattr(args, "count", None)
    if count is not None and count < 1:
        raise ValueError(f"--count must be >= 1, got {count}")
    n = 0
    while True:
        if server is not None:
            print_result(args, inspect_servers(server or None), _servers_text)
        else:
            print_result(args, inspect_stats(cfg), _inspect_text)
        n += 1
        if watch is None or (count is not None and n >= count):
            return 0
        sys.stdout.flush()
        time.sleep(watch)


def inspect_stats(cfg: StackConfig) -> dict:
    from kvtier.core.serving_stats import hit_ratios, read_stats
    from kvtier.tiers.nvme_control import make_fingerprint
    tiers = []
    for t in cfg.storage_tiers():
        if t.kind == "nvme":
            nv = open_nvme_read_only(cfg, with_data=False, as_stored=True) if os.path.isdir(t.path) else None
            if nv is None:
                tiers.append({"name": t.name, "kind": "nvme", "path": t.path, "resident_blocks": 0,
                              "capacity_blocks": t.blocks(cfg.block_bytes), "occupancy": 0.0,
                              "block_bytes": cfg.block_bytes, "eviction": t.eviction or cfg.policy.eviction,
                              "note": "no directory yet"})
                continue
            try:
                st = nv.stats()
            finally:
                nv.close()
            stored = _recorded_fingerprint(st.get("path") or t.path) or st["fingerprint"]
            st["fingerprint"] = stored
            st["block_bytes"] = int(stored.get("block_bytes", cfg.block_bytes))
            st["fingerprint_is"], st["config_differs_in"] = _fingerprint_note(
                stored, make_fingerprint(t.name, cfg.block_bytes, cfg.fingerprint()))
            served = read_stats(st.get("path") or t.path)
            if served is not None:  # a vLLM connector serves (or served) from this directory
                st["serving"] = hit_ratios(served)
            tiers.append(st)
        elif t.kind == "shared":
            tiers.append(inspect_shared(cfg, t))
        else:  # offline: a DRAM tier holds nothing; its capacity is what a stack would allocate
            tiers.append({"name": t.name, "kind": t.kind, "resident_blocks": 0,
                          "capacity_blocks": t.blocks(cfg.block_bytes), "occupancy": 0.0,
                          "block_bytes": cfg.block_bytes, "eviction": t.eviction or cfg.policy.eviction,
                          "note": "not allocated (offline)"})
    return {"config": cfg.source, "block_bytes": cfg.block_bytes, "tiers": tiers,
            "policies": {"eviction": cfg.policy.eviction, "admission": cfg.policy.admission,
                         "promotion": cfg.policy.promotion, "offload": cfg.policy.offload},
            "time": time.time()}


def inspect_servers(pid: int | None = None) -> dict:
    """What the vLLM servers on this host say about themselves (kvtier.core.serving_stats:
    each serving scheduler rewrites its state every second): found without their config."""
    from kvtier.core.serving_stats import hit_ratios, read_servers, run_dir
    servers = read_servers(pid)
    if pid is not None and not servers:
        raise ConfigError(f"inspect --server {pid}: no state from that pid in {run_dir()} (the server's "
                          f"KVTIER_RUN_DIR / XDG_RUNTIME_DIR must match this shell's)")
    for s in servers:
        s["hits"] = hit_ratios(s)
    return {"run_dir": run_dir(), "servers": servers, "time": time.time()}


def _servers_text(d: dict) -> str:
    if not d["servers"]:
        return f"no kvtier server has run here (no state in {d['run_dir']})"
    lines = []
    for s in d["servers"]:
        seen = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(s.get("time", 0))))
        how = f"serving (state {s['age_s']} s old)" if s["status"] == "serving" else \
            f"{s['status']} (last seen {seen}, {s['age_s']:.0f} s ago)"
        lines.append(f"server pid {s['pid']}: {how}")
        g = s.get("geometry") or {}
        lines.append(f"  geometry (as served): {g.get('block_tokens')}-token blocks of "
                     f"{format_size(int(g.get('block_bytes') or 0))}, model {g.get('model')}, KV {g.get('kv_dtype')}")
        lines.append(f"  config: {s.get('config')}" + (f"; recording to {s['record_trace']}" if s.get("record_trace") else ""))
        for t in s.get("tiers", []):
            lines.append(f"  {t['name']:<8} {t['kind']:<5} {t['resident_blocks']:>9} / {t['capacity_blocks']:<9} blocks"
                         + (f"  {t['dir']}" if t.get("dir") else ""))
        h = s["hits"]
        by = ", ".join(f"{k} {100 * v:.1f}%" for k, v in h["hit_ratio_by_tier"].items())
        lines.append(f"  block hit ratio {100 * h['hit_ratio']:.1f}%" + (f" ({by})" if by else "")
                     + f" of {h['blocks_looked_up']} blocks looked up, {h['lookups']} lookups")
        lines.extend(tenant_lines(s.get("tenants") or h.get("tenants") or {}, "  "))
    return "\n".join(lines)


def tenant_lines(tenants: dict, indent: str) -> list[str]:
    """One line per tenant: per tier, blocks held (of its quota), hits, stored, evicted."""
    out = []
    for name, per in tenants.items():
        parts = []
        for tier, d in per.items():
            held = f"held {d['held_blocks']}/{d['quota_blocks']} quota ({format_size(d['held_bytes'])}) " \
                if "held_blocks" in d else ""
            parts.append(f"{tier}: {held}hits {d.get('hits', 0)} stored {d.get('stored', 0)} "
                         f"evicted {d.get('evicted', 0)}")
        out.append(f"{indent}tenant {name}: " + ("; ".join(parts) or "nothing counted yet"))
    return out


def inspect_shared(cfg: StackConfig, t: Any) -> dict:
    """The shared tier's entries for this config's fingerprint, and how the server evicts."""
    from kvtier.core.builder import build_tier
    idx = next(i for i, c in enumerate(cfg.storage_tiers()) if c is t)
    shared = build_tier(cfg, idx, "control")
    try:
        n = shared.scan_count()
        d = {"name": t.name, "kind": "shared", "server": shared.settings.where, "namespace": shared.ns.ns,
             "resident_blocks": n or 0, "capacity_blocks": t.blocks(cfg.block_bytes), "occupancy": 0.0,
             "eviction": "server", "engine": shared.io_engine}
        if n is None:
            d["note"] = f"server unreachable: {shared.conn.ping() or 'no answer'}"
            return d
        try:
            mem = shared.conn.client.info("memory")
            d["server_memory"] = {k: mem.get(k) for k in ("used_memory", "maxmemory", "maxmemory_policy")}
            if not str(mem.get("maxmemory_policy", "")).startswith("allkeys") or not mem.get("maxmemory"):
                d["note"] = ("the server does not evict by itself (set maxmemory and maxmemory-policy "
                             "allkeys-lru): writes fail once it is full")
        except Exception:  # INFO refused by an ACL, or a cluster without one answer: entries only
            pass
        return d
    finally:
        shared.close()


def _fingerprint_note(stored: dict, ours: dict) -> tuple[str, list[str]]:
    """What is known about the fingerprint a directory was written under, said plainly."""
    differs = sorted(k for k in set(ours) | set(stored) if ours.get(k) != stored.get(k))
    if not differs:
        return "this config's", []
    if str(stored.get("layout", "")).startswith("vllm-kv-blocks/"):   # the connector's: the model's layout
        what = ", ".join(f"{k} {stored[k]}" for k in ("model", "dtype", "kv_cache_dtype", "tp", "pp", "block_bytes")
                         if k in stored)
        return (f"written by the vLLM connector ({what}): it takes the model, dtypes and block size from vLLM, "
                f"so they never match a YAML's own fields; vLLM serving that model from this path uses these "
                f"blocks; the CLI's spill/restore cannot (`kvtier fsck --dir PATH` checks them)"), differs
    return (f"written under another fingerprint than this config's (differs in "
            f"{', '.join(f'{k}: stored {stored.get(k)!r}, config {ours.get(k)!r}' for k in differs)})"), differs


def _recorded_fingerprint(path: str) -> dict | None:
    """The fingerprint the directory recorded at its first open (fingerprint.json), or None."""
    from kvtier.tiers.nvme_block import recorded_fingerprint
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        return recorded_fingerprint(fd, path)
    except OSError:
        return None
    finally:
        os.close(fd)


def _inspect_text(d: dict) -> str:
    lines = [f"config: {d['config']}  block_bytes: {d['block_bytes']} (the config's)  policies: {d['policies']}"]
    for t in d["tiers"]:
        bb = t.get("block_bytes")
        lines.append(f"  {t['name']:<8} {t['kind']:<5} {t['resident_blocks']:>9} / {t['capacity_blocks']:<9} blocks "
                     f"({100 * t['occupancy']:.1f}%)" + (f" of {format_size(bb)}" if bb else "") +
                     f"  eviction={t['eviction']}  engine={t.get('engine', '-')}")
        sv = t.get("serving")
        if sv:
            from kvtier.core.serving_stats import pid_alive
            head = f"           serving: pid {sv['pid']}, counters written {sv['age_s']} s ago: " \
                if isinstance(sv["pid"], int) and pid_alive(sv["pid"]) else \
                f"           served by pid {sv['pid']}: not running (last seen {sv['age_s']:.0f} s ago): "
            if not sv["blocks_looked_up"]:
                lines.append(head + f"no block looked up yet ({sv['lookups']} lookups)")
            else:
                by = ", ".join(f"{k} {100 * v:.1f}%" for k, v in sv["hit_ratio_by_tier"].items())
                lines.append(head + f"block hit ratio {100 * sv['hit_ratio']:.1f}%"
                             + (f" ({by})" if by else " (no hit in any tier)")
                             + f" of {sv['blocks_looked_up']} blocks looked up")
            lines.extend(tenant_lines(sv.get("tenants") or {}, "           "))
        for k in ("path", "server", "namespace", "fingerprint_is", "fingerprint", "server_memory", "corrupt_blocks",
                  "quarantined", "stored_capacity", "beyond_capacity", "note"):
            if t.get(k) not in (None, 0) or k in ("path", "quarantined"):
                if k in t:
                    lines.append(f"           {k}: {t[k]}")
    return "\n".join(lines)


def cmd_fsck(args: argparse.Namespace) -> int:
    from kvtier.tiers.nvme_recovery import fsck
    cfg = load_fitted(args.config, allocate=False)
    if getattr(args, "dir", None):   # a directory by path (e.g. the connector's): its recorded fingerprint
        if args.shrink:
            raise ConfigError("fsck: --shrink takes the capacity from --config's nvme tier, not --dir")
        path, shrink_to = os.path.expanduser(args.dir), None
        if not os.path.isdir(path):
            raise ConfigError(f"fsck: --dir {path}: not a directory")
    else:
        t = nvme_tier_config(cfg)
        path, shrink_to = t.path, t.blocks(cfg.block_bytes) if args.shrink else None
    r = fsck(path, cfg.block_bytes, cfg.fingerprint(), rebuild=args.rebuild, shrink_to=shrink_to)
    print_result(args, r, _fsck_text)
    if r["damaged"] and not args.rebuild:
        raise CommandFailed(f"fsck: {r['damaged']}", r)
    return 0


def _fsck_text(d: dict) -> str:
    def show(k: str, v: Any) -> str:
        if k == "damaged":
            return "no: the index agrees with the block headers" if not v else str(v)
        if v is None or v == []:
            return "none"
        return ", ".join(map(str, v)) if isinstance(v, list) else str(v)
    return "\n".join(f"{k}: {show(k, v)}" for k, v in d.items() if k != "problems") + \
        "".join(f"\n  {p}" for p in d.get("problems", [])[:20])
