"""The CLI commands: spill, restore, inspect, bench (and the offline operations behind them)."""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import sys
import time
from typing import Any, Callable

from kvtier.offline.blockgen import block_data, block_key, fill_block
from kvtier.core.config import ConfigError, StackConfig, check_environment, fit_to_machine, load_config
from kvtier.core.stack import TierStack
from kvtier.core.units import format_size

MANIFEST = "spill-manifest.json"
MANIFEST_FORMAT = 2   # 2: one record per spill (`spills`); 1 (no `format`): the last spill's only
log = logging.getLogger("kvtier")


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


def _nvme_cfg(cfg: StackConfig):
    for t in cfg.tiers:
        if t.kind == "nvme":
            return t
    raise ConfigError(f"{cfg.source}: tiers: this command needs an nvme tier")


def open_nvme_read_only(cfg: StackConfig, with_data: bool = True, as_stored: bool = False):
    """The config's NVMe tier opened read-only: no lock taken, nothing created, sized or
    allocated beyond one I/O engine (works on a live server's directory). `as_stored` (the
    index alone): open it under the fingerprint, block size and capacity it was written with
    (e.g. by the vLLM connector, whose fingerprint names the model), not the config's."""
    from kvtier.core.builder import make_eviction
    from kvtier.tiers.nvme import NvmeTier
    from kvtier.tiers.nvme_control import NvmeControl
    t = _nvme_cfg(cfg)
    if not os.path.isdir(t.path):
        raise OSError(errno.ENOENT, f"no nvme tier at {t.path} (nothing was spilled there)", t.path)
    cap = t.blocks(cfg.block_bytes)
    if not with_data:  # the index alone
        fp, bb = cfg.fingerprint(), cfg.block_bytes
        stored = stored_layout(t.path) if as_stored else None
        if stored is not None:
            fp, bb = stored["fingerprint"], int(stored["fingerprint"].get("block_bytes", bb))
            cap = int(stored.get("capacity") or cap)
        return NvmeControl(t.name, t.path, cap, bb, make_eviction(cfg, t, cap),
                           fingerprint=fp, on_mismatch=t.on_fingerprint_mismatch, read_only=True)
    return NvmeTier(t.name, t.path, cap, cfg.block_bytes, make_eviction(cfg, t, cap), io=t.io,
                    fingerprint=cfg.fingerprint(), on_mismatch=t.on_fingerprint_mismatch,
                    io_threads=t.io_threads, read_only=True, with_data=with_data)


def stored_layout(path: str) -> dict | None:
    """The fingerprint and capacity an NVMe tier directory was written with (read-only), or None."""
    from kvtier.tiers.nvme_index import NvmeIndex
    idx = os.path.join(path, "index")
    if not os.path.isfile(os.path.join(idx, "data.mdb")):
        return None
    ix = NvmeIndex(idx, 1, read_only=True)
    try:
        fp = ix.fingerprint()
        return None if fp is None else {"fingerprint": fp, "capacity": ix.get_meta("capacity")}
    finally:
        ix.close()


class CommandFailed(RuntimeError):
    """The command ran but its result is a failure (exit 1); `result` is still printed."""

    def __init__(self, message: str, result: dict | None = None, code: int = 1) -> None:
        super().__init__(message)
        self.result = result
        self.code = code


# ---- spill ------------------------------------------------------------------------------
def load_fitted(path: str | None, allocate: bool) -> StackConfig:
    """The config at `path` with its capacities resolved (`fit_to_machine`); `allocate`: the
    command builds its tiers, so paths and capacities are checked against this machine first
    (a tier that does not fit is one error naming it, never an OOM kill or ENOSPC later)."""
    cfg = load_config(path, check_env=False)
    if allocate:
        check_environment(cfg)
    return fit_to_machine(cfg, check=allocate)[0]


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
    _print(args, r, _spill_text)
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


def check_seed(seed: int | None) -> None:
    if seed is not None and not 0 <= seed < 1 << 63:
        raise ValueError(f"--seed must be in [0, 2**63), got {seed}")


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
    staging = _staging(batch, bb)
    log_f = open(args.commit_log, "a") if args is not None and getattr(args, "commit_log", None) else None
    bar = _progress(args, n, "spill") if args is not None else None
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
            if hasattr(t, "drain"):
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
            "digests": {str(j): _digest(seed, j, bb) for j in present}}
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
            "gbps": n * bb / io_s / 1e9 if io_s > 0 else 0.0, "engine": _engine(nvme), "tier": nvme.name,
            "nvme_resident": len(present), "dropped": dropped, "capacity_blocks": nvme.capacity_blocks,
            "evicted_earlier": evicted_earlier, "evicted_from_nvme": dropped, "seed": seed,
            "on_shared": None if on_shared is None else len(on_shared), "metrics": stack.metrics.as_dict()}


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
            e["digests"] = {str(j): _digest(e["seed"], j, nvme.block_bytes) for j in range(e["blocks"])
                            if block_key(e["seed"], j) in nvme}
        out.append(e)
    return out


def _shared(tiers) -> Any:
    return next((t for t in tiers if getattr(t, "remote", False)), None)


def _shared_manifest_name(shared: Any, seed: int) -> bytes:
    return shared.ns.prefix + b"manifest:" + str(seed).encode()


def put_shared_manifest(shared: Any, seed: int, n: int, present: list[int]) -> None:
    """The spill manifest of the shared tier, on the server next to the blocks (no expiry)."""
    bb = shared.block_bytes
    body = {"seed": seed, "blocks": n, "block_bytes": bb, "namespace": shared.ns.ns, "on_shared": len(present),
            "time": time.time(), "digests": {str(j): _digest(seed, j, bb) for j in present}}
    _on_server(shared, lambda cl: cl.set(_shared_manifest_name(shared, seed), _manifest_doc(body)))


def _on_server(shared: Any, fn: Callable[[Any], Any]) -> Any:
    """fn(redis client); a server error is an OSError naming the server (and trips its breaker)."""
    try:
        return fn(shared.conn.client)
    except Exception as e:   # redis-py's ConnectionError, TimeoutError, ResponseError, cluster errors
        if not type(e).__module__.startswith("redis"):
            raise
        shared.conn.breaker.fail(e)
        raise OSError(errno.EHOSTUNREACH, f"shared tier {shared.settings.where}: {type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else ''}", shared.settings.where) from None


def get_shared_manifest(shared: Any, seed: int | None) -> dict | None:
    """The shared tier's spill manifest of `seed` (None: the newest written), checked; None if none."""
    where = f"on shared tier {shared.settings.where} (namespace {shared.ns.ns})"
    if seed is not None:
        raw = _on_server(shared, lambda cl: cl.get(_shared_manifest_name(shared, seed)))
        return None if raw is None else _manifest_body(raw, where)
    names = _on_server(shared, lambda cl: list(cl.scan_iter(match=shared.ns.prefix + b"manifest:*", count=1000)))
    found = []
    for name in names:
        raw = _on_server(shared, lambda cl: cl.get(name))
        if raw is not None:
            found.append(_manifest_body(raw, where))
    return max(found, key=lambda m: float(m.get("time", 0)), default=None)


def _manifest_doc(body: dict) -> str:
    """A manifest as stored: the body and the xxh3 of its canonical JSON."""
    import xxhash
    text = json.dumps(body, sort_keys=True)
    return json.dumps({"manifest": body, "xxh3": xxhash.xxh3_64_hexdigest(text.encode())}, sort_keys=True)


def _manifest_body(raw: bytes, where: str) -> dict:
    """The body of a stored manifest (`_manifest_doc`), checked; damage is an OSError naming `where`."""
    import xxhash
    try:
        doc = json.loads(raw)
        body = doc["manifest"]
        ok = xxhash.xxh3_64_hexdigest(json.dumps(body, sort_keys=True).encode()) == doc["xxh3"]
    except (ValueError, KeyError, TypeError) as e:
        raise OSError(errno.EINVAL, f"spill manifest {where} is damaged or of an older format: {e!r}", where) \
            from None
    if not ok:
        raise OSError(errno.EINVAL, f"spill manifest {where} fails its checksum (damaged or edited)", where)
    return body


def _advance(durable: int, hi: int, nvme: Any, seed: int) -> int:
    """First index >= durable whose block is not yet on NVMe (everything before it is)."""
    while durable < hi and block_key(seed, durable) in nvme:
        durable += 1
    return durable


def _digest(seed: int, j: int, bb: int) -> str:
    import xxhash
    return xxhash.xxh3_64_hexdigest(memoryview(block_data(seed, j, bb).numpy()))


def write_manifest(nvme: Any, spills: list[dict]) -> None:
    """The spill manifest: namespace, fingerprint and one record per spill whose blocks are on
    NVMe (seed, blocks asked, a digest per block there; a spill begun but not yet recorded has
    no digests). Written 0600 without following symlinks, fsynced (file and directory), then
    renamed into place; a failure (e.g. ENOSPC) names the file and leaves no temp file behind."""
    body = {"format": MANIFEST_FORMAT, "block_bytes": nvme.block_bytes, "namespace": nvme.namespace,
            "dir": nvme.dir, "fingerprint": nvme.fingerprint, "spills": spills}
    data = _manifest_doc(body).encode()
    path = os.path.join(nvme.dir, MANIFEST)
    tmp = MANIFEST + ".tmp"
    dfd = os.open(nvme.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        try:
            os.unlink(tmp, dir_fd=dfd)
        except FileNotFoundError:
            pass
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dfd)
            try:
                while data:
                    data = data[os.write(fd, data):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, MANIFEST, src_dir_fd=dfd, dst_dir_fd=dfd)
            os.fsync(dfd)
        except OSError as e:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
            name = errno.errorcode.get(e.errno or 0, str(e.errno))
            raise OSError(e.errno, f"cannot write the spill manifest {path}: [{name}] {e.strerror}", path) from None
    finally:
        os.close(dfd)


MAX_MANIFEST_BYTES = 256 << 20


def read_manifest_if_dir(path: str) -> dict | None:
    """`read_manifest` of a directory that may not exist (None then)."""
    return read_manifest(path) if os.path.isdir(path) else None


def read_manifest(path: str) -> dict | None:
    """The spill manifest in `path`, checked (None when there is none). A FIFO, device, symlink or
    oversized file is refused without blocking; a damaged manifest is an error naming the file."""
    import stat as _stat

    p = os.path.join(path, MANIFEST)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise OSError(e.errno, f"spill manifest {p}: {e.strerror}" +
                      (" (a symlink: refused)" if e.errno == errno.ELOOP else ""), p) from None
    try:
        st = os.fstat(fd)
        if not _stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, f"spill manifest {p} is not a regular file; refused", p)
        if st.st_size > MAX_MANIFEST_BYTES:
            raise OSError(errno.EFBIG, f"spill manifest {p} is {st.st_size} bytes (limit {MAX_MANIFEST_BYTES})", p)
        chunks = []
        while True:
            c = os.read(fd, 1 << 20)
            if not c:
                break
            chunks.append(c)
    finally:
        os.close(fd)
    body = _manifest_body(b"".join(chunks), p)
    if "spills" not in body:   # format 1: the last spill's record at the top level
        body["spills"] = [{k: body.pop(k) for k in ("seed", "blocks", "on_nvme", "digests") if k in body}]
    try:
        for e in body["spills"]:
            e["seed"], e["blocks"] = int(e["seed"]), int(e["blocks"])
            if e.get("digests") is not None:
                e["digests"] = {str(int(j)): str(d) for j, d in e["digests"].items()}
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise OSError(errno.EINVAL, f"spill manifest {p} is malformed: {e!r}", p) from None
    return body


def _engine(tier: Any) -> str:
    return getattr(tier, "io_engine", None) or tier.stats().get("engine", "?")


# ---- restore ----------------------------------------------------------------------------
def cmd_restore(args: argparse.Namespace) -> int:
    check_seed(args.seed)
    cfg = load_fitted(args.config, allocate=False)
    t = _nvme_cfg(cfg)
    if any(c.kind == "redis" for c in cfg.tiers) and read_manifest_if_dir(t.path) is None:
        # this data dir holds no spill (another machine's, or empty): restore from the fleet's tier
        from kvtier.core.builder import build_tier
        idx = next(i for i, c in enumerate(cfg.storage_tiers()) if c.kind == "redis")
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
             f"{d['gbps']:.2f} GB/s; corrupt (detected, not served): {d['corrupt']}; missing: {d['missing']}")
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
        _print(args, r, text)  # the figures, then (on failure) the error line
    if r["bad_served"]:
        raise CommandFailed(f"restore: {r['bad_served']} blocks served with wrong contents", r, code=3)
    if args.verify and r["problem"]:
        raise CommandFailed(f"restore --verify: {r['problem']}", r)
    if args.strict and (r["corrupt"] or r["missing"] or not r["restored"]):
        raise CommandFailed(f"restore --strict: {r['corrupt']} corrupt, {r['missing']} missing, "
                            f"{r['restored']} restored", r)
    if getattr(args, "json", False):
        _print(args, r, text)
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
    base = {"index_entries": nvme.num_resident, "engine": _engine(nvme), "tier": nvme.name}
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
    r = _read_back(entries, lambda chunk, bufs: shared.get([k for _, k, _ in chunk], bufs), shared.block_bytes,
                   expected, verify, args, batch, drain=shared.conn.drain)
    absent = r["corrupt"]  # absent (evicted) and bad values are both misses on the shared tier
    problem = None
    if absent or r["bad_served"]:
        problem = (f"{absent} of the manifest's {len(expected)} blocks are absent from the shared tier "
                   f"(evicted by the server) or failed verification")
    stats = shared.stats()
    return _result(verify, problem if verify else None, True,
                   **{**r, "corrupt": int(stats.get("corrupt_blocks", 0))},
                   missing=int(stats.get("missing_blocks", 0)), expected=len(expected), seed=seed, seeds=[seed],
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
    staging = _staging(min(batch, max(1, len(entries))), bb)
    expect = torch.empty(bb, dtype=torch.uint8) if verify else None
    restored = corrupt = bad = good = 0
    bar = _progress(args, len(entries), "restore") if args is not None else None
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


# ---- inspect ----------------------------------------------------------------------------
def cmd_inspect(args: argparse.Namespace) -> int:
    """What each tier holds; the NVMe tier read-only (no lock, nothing allocated), so it works
    on a live server's directory. `--watch S` refreshes every S seconds until Ctrl-C."""
    cfg = load_fitted(args.config, allocate=False)
    watch = getattr(args, "watch", None)
    if watch is not None and not 0.1 <= watch <= 3600:
        raise ValueError(f"--watch must be between 0.1 and 3600 seconds, got {watch}")
    count = getattr(args, "count", None)
    if count is not None and count < 1:
        raise ValueError(f"--count must be >= 1, got {count}")
    n = 0
    while True:
        st = inspect_stats(cfg)
        _print(args, st, _inspect_text)
        n += 1
        if watch is None or (count is not None and n >= count):
            return 0
        sys.stdout.flush()
        time.sleep(watch)


def _fingerprint_note(stored: dict, ours: dict) -> tuple[str, list[str]]:
    """What is known about the fingerprint a directory was written under, said plainly."""
    differs = sorted(k for k in set(ours) | set(stored) if ours.get(k) != stored.get(k))
    if not differs:
        return "this config's", []
    if stored.get("layout") == "vllm-kv-blocks/v1":   # the connector's: the model's layout, not the YAML's
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
        elif t.kind == "redis":
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


def inspect_shared(cfg: StackConfig, t: Any) -> dict:
    """The shared tier's entries for this config's fingerprint, and how the server evicts."""
    from kvtier.core.builder import build_tier
    idx = next(i for i, c in enumerate(cfg.storage_tiers()) if c is t)
    shared = build_tier(cfg, idx, "control")
    try:
        n = shared.scan_count()
        d = {"name": t.name, "kind": "redis", "server": shared.settings.where, "namespace": shared.ns.ns,
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


def _inspect_text(d: dict) -> str:
    lines = [f"config: {d['config']}  block_bytes: {d['block_bytes']} (the config's)  policies: {d['policies']}"]
    for t in d["tiers"]:
        bb = t.get("block_bytes")
        lines.append(f"  {t['name']:<8} {t['kind']:<5} {t['resident_blocks']:>9} / {t['capacity_blocks']:<9} blocks "
                     f"({100 * t['occupancy']:.1f}%)" + (f" of {format_size(bb)}" if bb else "") +
                     f"  eviction={t['eviction']}  engine={t.get('engine', '-')}")
        sv = t.get("serving")
        if sv:
            head = f"           serving: pid {sv['pid']}, counters written {sv['age_s']} s ago: "
            if not sv["blocks_looked_up"]:
                lines.append(head + f"no block looked up yet ({sv['lookups']} lookups)")
            else:
                by = ", ".join(f"{k} {100 * v:.1f}%" for k, v in sv["hit_ratio_by_tier"].items())
                lines.append(head + f"block hit ratio {100 * sv['hit_ratio']:.1f}%"
                             + (f" ({by})" if by else " (no hit in any tier)")
                             + f" of {sv['blocks_looked_up']} blocks looked up")
        for k in ("path", "server", "namespace", "fingerprint_is", "fingerprint", "server_memory", "corrupt_blocks",
                  "quarantined", "stored_capacity", "beyond_capacity", "note"):
            if t.get(k) not in (None, 0) or k in ("path", "quarantined"):
                if k in t:
                    lines.append(f"           {k}: {t[k]}")
    return "\n".join(lines)


# ---- fsck -------------------------------------------------------------------------------
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
        t = _nvme_cfg(cfg)
        path, shrink_to = t.path, t.blocks(cfg.block_bytes) if args.shrink else None
    r = fsck(path, cfg.block_bytes, cfg.fingerprint(), rebuild=args.rebuild, shrink_to=shrink_to)
    _print(args, r, _fsck_text)
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


# ---- bench ------------------------------------------------------------------------------
def cmd_bench(args: argparse.Namespace) -> int:
    from kvtier.cli.bench import run_bench
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
        print(json.dumps(result, default=str), flush=True)
    else:
        print(text(result), flush=True)
