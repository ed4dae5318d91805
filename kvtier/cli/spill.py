"""`kvtier spill`: deterministic blocks written through the stack down to NVMe, recorded in the
spill manifest (and on the shared tier, when the stack has one)."""

from __future__ import annotations

import argparse
import logging
import os
import time
from typing import Any

from kvtier.cli.common import check_seed, engine_name, load_fitted, print_result, progress, staging_pool
from kvtier.cli.manifest import digest, put_shared_manifest, read_manifest, write_manifest
from kvtier.core.config import ConfigError
from kvtier.core.stack import TierStack
from kvtier.common.units import format_size
from kvtier.offline.blockgen import block_key, fill_block
from kvtier.tiers.contract import Medium

log = logging.getLogger("kvtier")


def cmd_spill(args: argparse.Namespace) -> int:
    if args.blocks <= 0:
        raise ValueError(f"--blocks must be > 0, got {args.blocks}")
    if args.batch <= 0:
        raise ValueError(f"--batch must be > 0, got {args.batch}")
    check_seed(args.seed)
    cfg = load_fitted(args.config, allocate=True)
    stack = TierStack.from_config(cfg)
    try:
        r = spill(stack, args.blocks, args.seed, args.batch, args)
    finally:
        stack.close()
    print_result(args, r, _spill_text)
    return 0


def _spill_text(d: dict) -> str:
    s = (f"spilled {d['blocks']} blocks ({format_size(d['bytes'])}) to {d['tier']} in {d['seconds']:.2f} s: "
         f"{d['gbps']:.2f} GB/s of stack I/O (data generation {d['gen_seconds']:.2f} s excluded); "
         f"engine: {d['engine']}; on nvme: {d['nvme_resident']} of {d['blocks']}")
    if d["dropped"]:
        s += f" ({d['dropped']} did not fit the tier's {d['capacity_blocks']} blocks: evicted, oldest first)"
    if d["evicted_earlier"]:
        s += f"; evicted to make room: {d['evicted_earlier']} blocks of earlier spills"
    if d.get("on_shared") is not None:
        s += f"; on the shared tier: {d['on_shared']} of {d['blocks']}"
    return s


def spill(stack: TierStack, n: int, seed: int, batch: int, args: Any = None) -> dict:
    """Write blocks 0..n-1 of `seed` through the stack down to NVMe, recorded in the directory's
    spill manifest: first as begun (before any block is written), then with a digest per block
    of it on NVMe (fsynced), next to the earlier spills' blocks still there. A write error stops
    it: the manifest lists what is durable and the error (errno, path) is raised."""
    ni = _nvme_index(stack)
    nvme = stack.tiers[ni]
    bb = stack.block_bytes
    spills = _earlier_spills(nvme, seed)
    write_manifest(nvme, spills + [{"seed": seed, "blocks": n, "complete": False}])  # before any block
    before = sum(len(e["digests"]) for e in spills)
    batch = max(1, min(batch, n))
    staging = staging_pool(batch, bb)
    log_f = open(args.commit_log, "a") if args is not None and getattr(args, "commit_log", None) else None
    bar = progress(args, n, "spill") if args is not None else None
    gen_s = io_s = 0.0
    durable = logged = 0
    failed: BaseException | None = None
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
    except OSError as e:
        failed = e
    finally:
        for t in stack.tiers:  # an interrupt may leave writes from `staging` in flight
            t.drain()
        if bar is not None:
            bar.close()
        if log_f:
            log_f.close()
        staging.close()
    present = [j for j in range(n) if block_key(seed, j) in nvme]
    for e in spills:  # the earlier spills' blocks this one evicted leave their records
        e["digests"] = {j: d for j, d in e["digests"].items() if block_key(e["seed"], int(j)) in nvme}
        e["on_nvme"] = len(e["digests"])
    evicted_earlier = before - sum(len(e["digests"]) for e in spills)
    this = {"seed": seed, "blocks": n, "complete": failed is None, "on_nvme": len(present),
            "digests": {str(j): digest(seed, j, bb) for j in present}}
    manifest_error: OSError | None = None
    try:
        write_manifest(nvme, [e for e in spills if e["digests"]] + [this])
    except OSError as e:   # e.g. the disk filled up: the begun record stays, the blocks verify by key
        manifest_error = OSError(e.errno, f"{len(present)} blocks of seed {seed} are committed on NVMe, but "
                                 f"{e.strerror} (the manifest keeps this spill as begun, without digests: "
                                 f"`restore --verify` checks its blocks against their keys)", e.filename)
    dropped = n - len(present)
    if dropped or evicted_earlier:
        log.warning("kvtier: spill: %s", "; ".join(filter(None, [
            f"{dropped} of the {n} blocks did not fit tier {nvme.name!r} ({nvme.capacity_blocks} blocks) "
            f"and were evicted, oldest first" if dropped else "",
            f"{evicted_earlier} blocks of earlier spills evicted to make room" if evicted_earlier else ""])))
    shared = _shared(stack.tiers)
    on_shared = None
    if shared is not None:  # the fleet's copy: its own manifest, kept on the server
        found = shared.conn.exists([block_key(seed, j) for j in range(n)])
        if found is None:   # unreachable (the breaker logged it): the NVMe spill stands on its own
            log.warning("kvtier: spill: shared tier %s unreachable: no spill manifest written there",
                        shared.settings.where)
        else:
            on_shared = [j for j, f in enumerate(found) if f]
            if not on_shared:
                log.warning("kvtier: spill: none of the %d blocks reached shared tier %s (its admission policy "
                            "%r admits a block only when it qualifies): nothing there to restore", n,
                            shared.settings.where, stack.cfg.storage_tiers()[stack.tiers.index(shared)].admission
                            or stack.cfg.policy.admission)
            try:
                put_shared_manifest(shared, seed, n, on_shared)
            except OSError as e:
                log.warning("kvtier: spill: %s", e)
                on_shared = None
    if failed is not None:
        if manifest_error is not None:
            log.warning("kvtier: spill: %s", manifest_error.strerror)
        raise failed
    if manifest_error is not None:
        raise manifest_error
    return {"blocks": n, "bytes": n * bb, "seconds": io_s, "gen_seconds": gen_s,
            "gbps": n * bb / io_s / 1e9 if io_s > 0 else 0.0, "engine": engine_name(nvme), "tier": nvme.name,
            "nvme_resident": len(present), "dropped": dropped, "capacity_blocks": nvme.capacity_blocks,
            "evicted_earlier": evicted_earlier, "evicted_from_nvme": dropped, "seed": seed,
            "on_shared": None if on_shared is None else len(on_shared), "metrics": stack.metrics.as_dict()}


def _nvme_index(stack: TierStack) -> int:
    for i, t in enumerate(stack.tiers):
        if t.medium is Medium.FILE:
            return i
    raise ConfigError(f"{stack.cfg.source}: tiers: spill/restore need an nvme tier")


def _earlier_spills(nvme: Any, seed: int) -> list[dict]:
    """The records of the earlier spills in the tier's manifest, less one of `seed` (a spill
    of the same seed replaces it); a damaged manifest is reported and started afresh (its
    blocks still verify against their keys)."""
    try:
        m = read_manifest(nvme.dir)
    except OSError as e:
        log.warning("kvtier: spill: %s; writing a new manifest", e)
        return []
    if m is None or m.get("namespace") != nvme.namespace or m.get("fingerprint") != nvme.fingerprint:
        return []
    out = []
    for e in m["spills"]:
        if e["seed"] == seed:
            continue
        if e.get("digests") is None:   # begun, never recorded (the manifest could not be written)
            e["digests"] = {str(j): digest(e["seed"], j, nvme.block_bytes) for j in range(e["blocks"])
                            if block_key(e["seed"], j) in nvme}
        out.append(e)
    return out


def _advance(durable: int, hi: int, nvme: Any, seed: int) -> int:
    """First index >= durable whose block is not yet on NVMe (everything before it is)."""
    while durable < hi and block_key(seed, durable) in nvme:
        durable += 1
    return durable


def _shared(tiers) -> Any:
    return next((t for t in tiers if t.shared), None)
