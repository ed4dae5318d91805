"""GPU <-> host copies of kvtier's worker against the machine's own limits (needs CUDA).

- scattered stores / loads (`connector/device_copy.DeviceCopier`: random block ids and pool
  slots, FlashAttention's token-major layout) against one pinned contiguous memcpy of the same
  bytes (D2H / H2D), as ratios;
- NVMe reads and writes of the CPU pool's blocks through kvikio (host buffers) against POSIX
  O_DIRECT (`tiers/nvme_data.NvmeData`), as ratios (GPUDirect Storage is not used for host
  buffers: the worker's NVMe I/O always goes through the pinned pool).

Prints a markdown table (and --json); `--results docs/results.md` appends it there.
Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time


def _median_time(fn, repeat: int) -> float:
    import torch
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copies(layers: int, heads: int, head: int, block_tokens: int, blocks: int, step_blocks: int,
           repeat: int) -> dict:
    import torch

    from kvtier.connector.device_copy import CudaStreams, DeviceCopier
    from kvtier.connector.kv_layout import KVLayout
    from kvtier.tiers.cpu_pool import host_buffer

    raw = torch.randn(layers, blocks, block_tokens, heads, 2 * head, dtype=torch.bfloat16, device="cuda")
    kv = {f"l{i}": raw[i].permute(0, 2, 1, 3) for i in range(layers)}
    lay = KVLayout(kv)
    bb = lay.block_bytes
    pool = host_buffer(step_blocks * 2 * bb, pin=True, row_bytes=bb, what="bench pool")
    rows = pool.tensor.view(-1, bb)
    dc = DeviceCopier(lay.canon, lay.offsets, CudaStreams(lay.device))
    g = torch.Generator().manual_seed(0)
    ids = torch.randperm(blocks, generator=g)[:step_blocks].tolist()
    slots = torch.randperm(rows.shape[0], generator=g)[:step_blocks].tolist()
    nbytes = step_blocks * bb
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = rows[:step_blocks].reshape(-1)
    d2h = _median_time(lambda: host.copy_(dev, non_blocking=True), repeat)
    h2d = _median_time(lambda: dev.copy_(host, non_blocking=True), repeat)
    store = _median_time(lambda: dc.streams.sync(dc.store(rows, ids, slots)), repeat)
    load = _median_time(lambda: dc.streams.sync(dc.load(rows, ids, slots)[-1]), repeat)
    ok = all(torch.equal(rows[s], torch.cat([f[b].reshape(-1).cpu() for f in lay.canon])) for b, s in zip(ids[:8], slots[:8]))
    pool.close()
    return {"block_bytes": bb, "step_blocks": step_blocks, "pinned": pool.pinned, "byte_exact": ok,
            "d2h_gbps_limit": nbytes / d2h / 1e9, "h2d_gbps_limit": nbytes / h2d / 1e9,
            "store_gbps": nbytes / store / 1e9, "load_gbps": nbytes / load / 1e9,
            "store_ratio": d2h / store, "load_ratio": h2d / load}


def nvme(directory: str, block_bytes: int, blocks: int, repeat: int) -> dict:
    import torch

    from kvtier.connector.nvme import NvmeControl, NvmeData
    from kvtier.policies.lru import LRU
    from kvtier.tiers.cpu_pool import host_buffer

    out = {}
    buf = host_buffer(blocks * block_bytes, pin=True, row_bytes=block_bytes, what="bench buffer")
    rows = list(buf.tensor.view(blocks, block_bytes).unbind(0))
    for r in rows:
        r.random_(0, 255)
    keys = [i.to_bytes(8, "big") + b"\0\0\0\0" for i in range(blocks)]
    for io in ("posix", "kvikio"):
        d = os.path.join(directory, io)
        ctl = NvmeControl("nvme", d, blocks, block_bytes, LRU(blocks))
        try:
            data = NvmeData(d, blocks, block_bytes, io=io)
        except Exception as e:  # kvikio not installed / no driver: say so
            out[io] = {"error": str(e)}
            ctl.close()
            continue
        sums = [0] * blocks
        slots = list(range(blocks))
        w = _median_time(lambda: (data.write(slots, rows, sums, keys=keys).wait(), data.sync()), repeat)
        bad = [False] * blocks
        rd = _median_time(lambda: data.read(slots, rows, sums, bad, keys=keys).wait(), repeat)
        out[io] = {"write_gbps": blocks * block_bytes / w / 1e9, "read_gbps": blocks * block_bytes / rd / 1e9,
                   "engine": data.description, "verified": not any(bad)}
        data.close()
        ctl.close()
    buf.close()
    if "error" not in out.get("kvikio", {"error": 1}):
        out["kvikio_vs_posix"] = {"write": out["kvikio"]["write_gbps"] / out["posix"]["write_gbps"],
                                  "read": out["kvikio"]["read_gbps"] / out["posix"]["read_gbps"]}
    return out


def table(res: dict) -> str:
    lines = [f"## GPU path (`bash benchmarks/gpu/run.sh`), {res['device']}, {res['date']}", "",
             "| what | ours GB/s | limit GB/s | ratio |", "|---|---|---|---|"]
    for c in res["copies"]:
        lines.append(f"| scattered store D2H, {c['step_blocks']} blocks x {c['block_bytes'] >> 10} KiB "
                     f"({'pinned' if c['pinned'] else 'PAGEABLE'}) | {c['store_gbps']:.1f} | "
                     f"{c['d2h_gbps_limit']:.1f} (one pinned memcpy) | {c['store_ratio']:.2f} |")
        lines.append(f"| scattered load H2D, same | {c['load_gbps']:.1f} | {c['h2d_gbps_limit']:.1f} | "
                     f"{c['load_ratio']:.2f} |")
    nv = res.get("nvme", {})
    for io in ("posix", "kvikio"):
        r = nv.get(io, {})
        if "error" in r:
            lines.append(f"| NVMe {io} | not run: {r['error'][:100]} | | |")
        elif r:
            lines.append(f"| NVMe {io} write / read ({r['engine'][:40]}) | {r['write_gbps']:.2f} / "
                         f"{r['read_gbps']:.2f} | | |")
    if "kvikio_vs_posix" in nv:
        k = nv["kvikio_vs_posix"]
        lines.append(f"| kvikio / POSIX O_DIRECT, write / read | | | {k['write']:.2f} / {k['read']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="directory on the NVMe to test (default: a temp dir)")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--results", default=None, help="append the table to this markdown file")
    a = ap.parse_args()
    try:
        import torch
        have = torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        have = False
    if not have:
        print("benchmarks/gpu/copy_bench.py: no CUDA device: skipped")
        return 0
    import datetime
    res = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(), "copies": []}
    for layers, heads, head, bt, step in ((32, 8, 128, 16, 256), (64, 1, 128, 16, 1024)):
        res["copies"].append(copies(layers, heads, head, bt, blocks=20000, step_blocks=step, repeat=a.repeat))
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        res["nvme"] = nvme(d, 1 << 20, 256, a.repeat)
    out = json.dumps(res, indent=1) if a.json else table(res)
    print(out)
    if a.results:
        with open(a.results, "a") as f:
            f.write("\n" + table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
