"""`kvtier bench`: tier throughput printed next to this machine's own limits, measured in the same run."""

from __future__ import annotations

import argparse
import contextlib
import errno
import random
import statistics
import tempfile
import time
from typing import Iterator

import torch

from kvtier.cli.common import print_result
from kvtier.common.units import format_size, parse_size


ENC_LIMIT = "the plain tier's {what}, same run (AES-256-GCM vs none)"


def bench_cpu(block_bytes: int, total: int, repeat: int) -> list[dict]:
    from kvtier.policies.lru import LRU
    from kvtier.tiers.cpu import CpuTier
    from kvtier.tiers.cpu_pool import CpuPool

    n = max(1, total // block_bytes)
    total = n * block_bytes
    tier = CpuTier("cpu", n, block_bytes, LRU(n))
    staging = CpuPool(n, block_bytes, pin="auto")
    staging.buffer.fill_(0x5A)
    slots = tier.allocate([i.to_bytes(8, "big") for i in range(n)])
    random.Random(0).shuffle(slots)  # scattered slots, as in service: no run to coalesce
    srcs = staging.views
    a = torch.ones(total, dtype=torch.uint8)
    b = torch.zeros(total, dtype=torch.uint8)
    def limit() -> None:
        b.copy_(a)
        time.sleep(0.02)  # let torch's intra-op threads stop spinning before the next copy

    runs = {"limit": limit, "put": lambda: tier.write(slots, srcs).wait(),
            "get": lambda: tier.read(slots, srcs).wait()}
    try:
        # interleaved, so a noisy stretch of the machine hits the limit and ours alike;
        # ratios are taken per repeat, then the median
        times: dict[str, list[float]] = {k: [] for k in runs}
        for fn in runs.values():
            fn()  # warm-up
        for _ in range(repeat):
            for k, fn in runs.items():
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0 - (0.02 if k == "limit" else 0.0))
        assert all(torch.equal(tier.view(s), v) for s, v in zip(slots[:8], staging.views[:8]))
    finally:
        tier.close()
        staging.close()
    med = statistics.median
    limit = total / med(times["limit"]) / 1e9
    put, get = total / med(times["put"]) / 1e9, total / med(times["get"]) / 1e9
    put_r = med(l / t for l, t in zip(times["limit"], times["put"]))
    get_r = med(l / t for l, t in zip(times["limit"], times["get"]))
    lim = "memcpy (one contiguous copy, all cores)"
    return [{"what": "cpu put", "block_bytes": block_bytes, "ours_gbps": put, "limit_gbps": limit,
             "ratio": put_r, "limit": lim},
            {"what": "cpu get", "block_bytes": block_bytes, "ours_gbps": get, "limit_gbps": limit,
             "ratio": get_r, "limit": lim}]


def bench_nvme(directory: str, block_bytes: int, total: int, repeat: int, encrypted: bool = False) -> list[dict]:
    from kvtier.cli.bench_nvme import run_nvme_bench

    n = max(1, total // block_bytes)
    r = run_nvme_bench(directory, block_bytes, n, repeats=repeat, encrypted=encrypted)
    rows = []
    for what, ours, limit, ratio in (
            ("nvme spill (write)", "spill_GBps", "limit_write_GBps", "spill_ratio_per_repeat_median"),
            ("nvme restore (read)", "restore_GBps", "limit_read_GBps", "restore_ratio_per_repeat_median")):
        rows.append({"what": what, "block_bytes": block_bytes, "ours_gbps": r[ours], "limit_gbps": r[limit],
                     "ratio": r[ratio],
                     "limit": f"O_DIRECT sequential {'write' if 'write' in limit else 'read'}, same bytes, same run",
                     "engine": r.get("engine")})
    for what, ours, plain, ratio in (
            ("nvme spill encrypted", "spill_encrypted_GBps", "spill_GBps", "spill_encrypted_ratio"),
            ("nvme restore encrypted", "restore_encrypted_GBps", "restore_GBps", "restore_encrypted_ratio")):
        if ours in r:
            rows.append({"what": what, "block_bytes": block_bytes, "ours_gbps": r[ours], "limit_gbps": r[plain],
                         "ratio": r[ratio], "limit": ENC_LIMIT.format(what=what.split()[1]), "engine": r.get("engine")})
    return rows


def run_bench(args: argparse.Namespace) -> dict:
    try:
        sizes = [parse_size(s) for s in str(args.sizes).split(",") if s.strip()]
    except ValueError as e:
        raise ValueError(f"--sizes: {e}") from None
    try:
        total = parse_size(args.total)
    except ValueError as e:
        raise ValueError(f"--total: {e}") from None
    if not sizes or min(sizes) <= 0:
        raise ValueError(f"--sizes: every block size must be > 0, got {args.sizes!r}")
    if total < max(sizes):
        raise ValueError(f"--total ({args.total}) must hold at least one block of the largest --sizes "
                         f"({max(sizes)} bytes)")
    if args.repeat < 1:
        raise ValueError(f"--repeat must be >= 1, got {args.repeat}")
    if getattr(args, "redis_threads", 4) < 1:
        raise ValueError(f"--redis-threads must be >= 1, got {args.redis_threads}")
    rows: list[dict] = []
    notes = [f"torch threads: {torch.get_num_threads()}"]
    if not getattr(args, "skip_cpu", False):
        _check_memory(4 * total, "the cpu rows (--total x 4: tier, staging and the memcpy limit's two buffers)")
        for bb in sizes:
            rows += bench_cpu(bb, total, args.repeat)
    if not args.skip_nvme:
        directory = args.dir
        if directory is None:   # the config's nvme path: its file system is the one measured
            from kvtier.core.config import load_config
            cfg = load_config(args.config, check_env=False)  # its tiers are not built, only the path used
            nv = [t for t in cfg.tiers if t.kind == "nvme"]
            directory = nv[0].path if nv else None
        _check_memory(2 * max(sizes) * max(1, total // max(sizes)), "the nvme rows (--total x 2: source and "
                      "destination buffers)")
        with _bench_dir(directory, total, max(sizes)) as d:
            for bb in sizes:
                rows += bench_nvme(d, bb, total, args.repeat, encrypted=not getattr(args, "skip_encrypted", False))
        notes.append(f"nvme files in a temporary directory under {directory or tempfile.gettempdir()}, removed after")
    from kvtier.cli.bench_shared import bench_shared, shared_settings
    rs = shared_settings(args)
    if rs is not None:
        threads = getattr(args, "redis_threads", 4)
        for bb in sizes:
            rows += bench_shared(rs, bb, total, args.repeat, threads,
                                 encrypted=not getattr(args, "skip_encrypted", False))
        notes.append(f"shared tier: {rs.where}, {threads} pipelines of <= {rs.batch_bytes >> 20} MiB in flight; "
                     f"its keys deleted after ({sum(r['keys_left'] for r in rows if 'keys_left' in r)} left)")
    return {"repeat": args.repeat, "total_bytes": total, "rows": rows, "notes": notes}


def _check_memory(need: int, what: str) -> None:
    from kvtier.core.fit import available_memory, memory_headroom
    room = available_memory() - memory_headroom()
    if need > room:
        raise ValueError(f"--total: {what} need {format_size(need)} of memory, only {format_size(max(0, room))} "
                         f"available (MemAvailable less headroom); give a smaller --total")


@contextlib.contextmanager
def _bench_dir(directory: str | None, total: int, block_bytes: int) -> Iterator[str]:
    """A temp directory under `directory` (created 0700 with its parents when missing, and
    removed again after), checked for the space the nvme rows take."""
    import os
    import shutil
    from kvtier.tiers.nvme_block import make_private_dirs, slot_stride
    top = None
    if directory is not None and not os.path.lexists(directory):
        top = os.path.abspath(directory)
        while not os.path.lexists(os.path.dirname(top)):
            top = os.path.dirname(top)
        make_private_dirs(directory)
    try:
        where = directory or tempfile.gettempdir()
        need = total + max(1, total // block_bytes) * slot_stride(block_bytes) + (8 << 20)  # raw file + tier
        free = shutil.disk_usage(where).free
        if need > free:
            raise OSError(errno.ENOSPC, f"bench: the nvme rows need {format_size(need)} on disk (--total as a raw "
                          f"file and as a tier), only {format_size(free)} free at {where}; give a smaller --total "
                          f"or another --dir", where)
        with tempfile.TemporaryDirectory(prefix="kvtier-bench-", dir=directory) as d:
            yield d
    finally:
        if top is not None:
            shutil.rmtree(top, ignore_errors=True)


def cmd_bench(args: argparse.Namespace) -> int:
    r = run_bench(args)
    print_result(args, r, _bench_text)
    return 0


def _bench_text(d: dict) -> str:
    lines = [f"kvtier bench (median of {d['repeat']}, {format_size(d['total_bytes'])} per run)",
             f"{'what':<24}{'block':>10}{'ours GB/s':>12}{'limit GB/s':>12}{'ratio':>8}  limit"]
    for row in d["rows"]:
        lines.append(f"{row['what']:<24}{format_size(row['block_bytes']):>10}{row['ours_gbps']:>12.2f}"
                     f"{row['limit_gbps']:>12.2f}{row['ratio']:>8.2f}  {row['limit']}")
    for note in d.get("notes", []):
        lines.append(f"note: {note}")
    return "\n".join(lines)
