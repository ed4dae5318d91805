"""`kvtier restore`: read back what a spill left on NVMe (or on the shared tier), with
`--verify` each block checked against its regenerated contents and the manifest's digest."""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from kvtier.cli.common import (CommandFailed, check_seed, engine_name, load_fitted, nvme_tier_config,
                               open_nvme_read_only, print_result, progress, staging_pool)
from kvtier.cli.manifest import get_shared_manifest, read_manifest, read_manifest_if_dir
from kvtier.common.units import format_size
from kvtier.offline.blockgen import block_key, fill_block


def cmd_restore(args: argparse.Namespace) -> int:
    check_seed(args.seed)
    cfg = load_fitted(args.config, allocate=False)
    t = nvme_tier_config(cfg)
    if any(c.kind == "shared" for c in cfg.tiers) and read_manifest_if_dir(t.path) is None:
        # this data dir holds no spill (another machine's, or empty): restore from the fleet's tier
        from kvtier.core.builder import build_tier
        idx = next(i for i, c in enumerate(cfg.storage_tiers()) if c.kind == "shared")
        shared = build_tier(cfg, idx, "full")
        try:
            r = restore_shared(shared, args.seed, args.verify, args)
        finally:
            shared.close()
    else:
        nvme = open_nvme_read_only(cfg)
        try:
            r = restore(nvme, args.seed, args.verify, args)
        finally:
            nvme.close()

    def text(d: dict) -> str:
        s = (f"restored {d['restored']} blocks ({format_size(d['bytes'])}) from {d['tier']} in {d['seconds']:.2f} s: "
             f"{d['gbps']:.2f} GB/s; corrupt (detected, not served): {d['corrupt']}"
             + (f" ({d['decrypt_failed']} did not decrypt: wrong key)" if d.get("decrypt_failed") else "")
             + f"; missing: {d['missing']}")
        if d["verify"]:
            seeds = ", ".join(map(str, d["seeds"]))
            s += (f"; verified against the regenerated spill data (seed{'s' if len(d['seeds']) > 1 else ''} "
                  f"{seeds}): {d['verified_blocks']} of {d['expected']}")
            if d.get("unrecorded"):
                s += f" ({d['unrecorded']} of them not in the manifest: checked against their keys alone)"
            s += f", content mismatches served as good: {d['bad_served']}"
        return s + f"; engine: {d['engine']}"
    if args.verify and r["problem"] and not r["read"]:   # known before reading: no figures to show
        raise CommandFailed(f"restore --verify: {r['problem']}", r)
    if not getattr(args, "json", False):
        print_result(args, r, text)  # the figures, then (on failure) the error line
    if r["bad_served"]:
        raise CommandFailed(f"restore: {r['bad_served']} blocks served with wrong contents", r, code=3)
    if args.verify and r["problem"]:
        raise CommandFailed(f"restore --verify: {r['problem']}", r)
    if args.strict and (r["corrupt"] or r["missing"] or not r["restored"]):
        raise CommandFailed(f"restore --strict: {r['corrupt']} corrupt, {r['missing']} missing, "
                            f"{r['restored']} restored", r)
    if getattr(args, "json", False):
        print_result(args, r, text)
    return 0


def _result(verify: bool, problem: str | None, read: bool, **kw: Any) -> dict:
    r = {"restored": 0, "corrupt": 0, "bad_served": 0, "verified_blocks": 0, "bytes": 0, "seconds": 0.0,
         "gbps": 0.0, "missing": 0, "expected": 0, "unrecorded": 0, "seeds": []}
    r.update(kw)
    r.update(verify=verify, problem=problem, read=read, verified=verify and problem is None)
    return r


def restore(nvme: Any, seed: int | None, verify: bool, args: Any = None, batch: int = 64) -> dict:
    """Read back every block in the index; with `verify`, every spill block instead (of `seed`,
    or of every spill), each checked against its regenerated contents and the manifest's digest.
    The manifest lists each spill's blocks (so missing ones are found); a spilled block it does
    not list (its spill could not record it) is checked against its key alone. `problem` says why
    a verify fails (wrong seed, other namespace, missing or corrupt blocks, nothing to verify);
    `read` is False when that was known before reading anything."""
    from kvtier.offline.blockgen import split_block_key
    base = {"index_entries": nvme.num_resident, "engine": engine_name(nvme), "tier": nvme.name}
    manifest = read_manifest(nvme.dir) if nvme.dir and os.path.isdir(nvme.dir) else None
    if manifest is not None and (manifest.get("namespace") != nvme.namespace
                                 or manifest.get("fingerprint") != nvme.fingerprint):
        if verify:
            return _result(verify, f"the manifest in {nvme.dir} was written for namespace "
                           f"{manifest.get('namespace')!r}, this tier is {nvme.namespace!r} (another fingerprint)",
                           False, seed=seed, **base)
        manifest = None
    records = {e["seed"]: e for e in (manifest or {}).get("spills", [])}
    # every spill block in the index by (seed, index); the manifest's blocks it lacks are missing
    spilled: dict[tuple[int, int], tuple[int, bytes]] = {}
    for k, s in nvme.resident.items():
        ref = split_block_key(k)
        if ref is not None:
            spilled[ref] = (s, k)
    listed = {(sd, int(j)): d for sd, e in records.items() for j, d in (e.get("digests") or {}).items()}
    if not verify:
        entries = sorted((s, k, None) for k, s in nvme.resident.items())
        missing = sum(1 for ref in listed if ref not in spilled)
        expected: dict = {}
        seeds: list[int] = []
    else:
        have = sorted(set(records) | {sd for sd, _ in spilled})
        if seed is not None and seed not in have:
            return _result(verify, f"wrong seed {seed}: " + (
                f"the manifest in {nvme.dir} lists the spills of seed{'s' if len(have) > 1 else ''} "
                f"{', '.join(map(str, have))}" if have else f"no spill in {nvme.dir}"), False, seed=seed, **base)
        seeds = [seed] if seed is not None else have
        want = {ref: d for ref, d in listed.items() if ref[0] in seeds}
        want.update({ref: None for ref in spilled if ref[0] in seeds and ref not in listed})  # by key alone
        if not want:
            why = (f"no spill manifest in {nvme.dir} and no spilled block in its index" if manifest is None
                   else f"the manifest in {nvme.dir} lists no block on NVMe and its index holds no spilled block")
            return _result(verify, f"nothing to verify: {why}", False, seed=seed, seeds=seeds, **base)
        entries = [(spilled[ref][0], spilled[ref][1], ref) for ref in sorted(want) if ref in spilled]
        missing = len(want) - len(entries)
        expected = want
    r = _read_back(entries, lambda chunk, bufs: nvme.read([s for s, _, _ in chunk], bufs), nvme.block_bytes,
                   expected, verify, args, batch, drain=getattr(nvme, "drain", None))
    problem = None
    if verify and (missing or r["corrupt"] or r["bad_served"]):
        problem = (f"{missing} of the manifest's {len(listed)} blocks are missing from the index "
                   f"(evicted or lost) and {r['corrupt']} failed verification")
    unrecorded = sum(1 for d in expected.values() if d is None)
    r["decrypt_failed"] = int(nvme.stats().get("decrypt_failed_blocks", 0))
    return _result(verify, problem, True, **r, missing=missing, expected=len(expected), unrecorded=unrecorded,
                   seed=seed if seed is not None else (seeds[-1] if len(seeds) == 1 else None), seeds=seeds,
                   **base)


def restore_shared(shared: Any, seed: int | None, verify: bool, args: Any = None, batch: int = 64) -> dict:
    """`restore` from the shared tier: the blocks its spill manifest (kept on the server) lists."""
    manifest = get_shared_manifest(shared, seed)
    base = {"index_entries": None, "engine": shared.io_engine, "tier": shared.name}
    if manifest is None:
        return _result(verify, f"nothing to restore: no spill manifest{'' if seed is None else f' of seed {seed}'} "
                       f"on {shared.settings.where} for namespace {shared.ns.ns} (another fingerprint, or the "
                       f"server evicted or lost it)", False, seed=seed, **base)
    seed = manifest["seed"]
    expected = {(seed, int(j)): d for j, d in manifest["digests"].items()}
    if not expected:
        problem = (f"nothing to {'verify' if verify else 'restore'}: the shared tier's spill manifest of seed "
                   f"{seed} on {shared.settings.where} lists none of its {manifest.get('blocks', '?')} blocks "
                   f"(the tier's admission policy kept them off the server, or they were evicted)")
        return _result(verify, problem, False, seed=seed, seeds=[seed], **base)
    entries = [(None, block_key(*ref), ref) for ref in sorted(expected)]
    r = _read_back(entries, lambda chunk, bufs: shared.conn.read((), bufs, [k for _, k, _ in chunk]),
                   shared.block_bytes, expected, verify, args, batch, drain=shared.conn.drain)
    absent = r["corrupt"]  # absent (evicted) and bad values are both misses on the shared tier
    problem = None
    if absent or r["bad_served"]:
        problem = (f"{absent} of the manifest's {len(expected)} blocks are absent from the shared tier "
                   f"(evicted by the server) or failed verification")
    stats = shared.stats()
    return _result(verify, problem if verify else None, True,
                   **{**r, "corrupt": int(stats.get("corrupt_blocks", 0))},
                   missing=int(stats.get("missing_blocks", 0)), expected=len(expected), seed=seed, seeds=[seed],
                   decrypt_failed=int(stats.get("decrypt_failed_blocks", 0)),
                   **base)


def _read_back(entries: list, read, bb: int, expected: dict, verify: bool, args: Any, batch: int,
               drain=None) -> dict:
    """Read `entries` ((slot, key, (seed, spill index))) in batches with `read(chunk, bufs)`;
    with `verify` each block is compared with its regenerated contents and, where `expected`
    has one, its digest. `drain()` waits for reads still in flight (an interrupt) before the
    staging rows are freed."""
    import torch
    import xxhash
    batch = max(1, min(batch, (32 << 20) // bb))  # at most 32 MiB of staging
    staging = staging_pool(min(batch, max(1, len(entries))), bb)
    expect = torch.empty(bb, dtype=torch.uint8) if verify else None
    restored = corrupt = bad = good = 0
    bar = progress(args, len(entries), "restore") if args is not None else None
    t_io = 0.0
    try:
        for lo in range(0, len(entries), batch):
            chunk = entries[lo:lo + batch]
            t0 = time.perf_counter()
            res = read(chunk, staging.views[:len(chunk)]).wait()
            t_io += time.perf_counter() - t0
            for i, ((_, _, ref), ok) in enumerate(zip(chunk, res.ok)):
                if not ok:
                    corrupt += 1
                    continue
                restored += 1
                if expect is not None:
                    fill_block(expect, *ref)
                    digest = expected.get(ref)
                    if torch.equal(staging.views[i], expect) and (
                            digest is None or xxhash.xxh3_64_hexdigest(memoryview(staging.views[i].numpy())) == digest):
                        good += 1
                    else:
                        bad += 1
            if bar is not None:
                bar.update(len(chunk))
    finally:
        if drain is not None:
            drain()
        if bar is not None:
            bar.close()
        staging.close()
    return {"restored": restored, "corrupt": corrupt, "bad_served": bad, "verified_blocks": good,
            "bytes": restored * bb, "seconds": t_io, "gbps": restored * bb / t_io / 1e9 if t_io > 0 else 0.0}
