"""How long a step waits for kvtier's stores: write-through in the step vs write-behind.

The connector's scheduler and worker halves (no vLLM) on real files: a "prefill" step stores
`--blocks` blocks (GPU -> CPU copy, then NVMe write-through), followed by decode steps whose
forward is `--forward-ms` of sleep (on a GPU the CPU is free during the forward). The stall is the
time `wait_for_save` + `build_connector_worker_meta` take in a step, summed over the prefill and
the following steps. Reported next to this machine's own limits measured in the same run: the
CPU copy alone, and the CPU copy plus an O_DIRECT write + fdatasync of the same bytes.

    python benchmarks/store_stall.py                 # 128 blocks x 512 KiB (a 4096-token prompt of
                                                     # the TTFT model), 20 ms forward, 7 repeats
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

from kvtier.tiers.nvme_control import NvmeControl
from kvtier.connector.scheduler import KVTierScheduler
from kvtier.core.controller import TierController
from kvtier.policies import PROMOTION
from kvtier.connector.config import load_settings
from kvtier.connector.worker import KVTierWorker
from kvtier.policies import EVICTION
from kvtier.tiers.base import SlotTier

LAYERS, BT, KVH, HD = 16, 32, 4, 64      # the TTFT model's KV: 512 KiB per 32-token block (bf16)


def _req(rid: str, n_tokens: int):
    r = type("Req", (), {})()
    r.request_id = rid
    r.num_tokens = n_tokens
    r.block_hashes = [rid.encode().ljust(24, b".") + i.to_bytes(8, "little") for i in range(n_tokens // BT)]
    return r


def run(lag: int, blocks: int, forward_s: float, decode_steps: int, d: str, rep: int) -> float:
    bb = LAYERS * 2 * BT * KVH * HD * 2
    nb = blocks + 2
    cpu = SlotTier("cpu", blocks * 2, bb, EVICTION.get("lru")(blocks * 2))
    nv = NvmeControl("nvme", d, blocks * 4, bb, EVICTION.get("lru")(blocks * 4), {"model": "stall"})
    s = KVTierScheduler(TierController([cpu, nv], block_tokens=BT, promotion=PROMOTION.get("inclusive")()))
    w = KVTierWorker(load_settings({"cpu_capacity_blocks": blocks * 2, "pin": False, "nvme_write_lag_steps": lag}))
    g = torch.Generator().manual_seed(rep)
    kv = {f"l{i}": torch.randint(-100, 100, (nb, 2, BT, KVH, HD), generator=g, dtype=torch.int16)
          .view(torch.bfloat16) for i in range(LAYERS)}
    w.register_kv_caches(kv)
    r = _req(f"r{rep}", blocks * BT + 1)
    s.lookup(r, 0)
    ids = list(range(nb - 1))
    s.on_alloc(r, [ids], 0)
    stall = 0.0
    for i in range(decode_steps + 1):
        meta = s.build_meta([(r.request_id, r.num_tokens, [ids])] if i == 0 else [])
        w.bind(meta)
        w.start_load()
        time.sleep(forward_s)                   # the forward
        t0 = time.perf_counter()
        w.save()
        s.on_worker_meta(w.take_report())
        stall += time.perf_counter() - t0
    assert nv.num_resident == blocks, (nv.num_resident, blocks)   # everything durable and indexed
    w.close()
    s.close()
    return stall


def limits(blocks: int, d: str) -> tuple[float, float]:
    """CPU copy of the same bytes; that copy plus an O_DIRECT write + fdatasync of them."""
    import mmap
    bb = LAYERS * 2 * BT * KVH * HD * 2
    n = blocks * bb
    src = torch.randint(0, 255, (n,), dtype=torch.uint8)
    mm = mmap.mmap(-1, n)
    dst = torch.frombuffer(mm, dtype=torch.uint8)
    dst.zero_()
    t0 = time.perf_counter()
    dst.copy_(src)
    t_copy = time.perf_counter() - t0
    path = os.path.join(d, "limit.bin")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o644)
    except OSError:  # a filesystem without O_DIRECT (tmpfs): buffered, and say so
        print(f"note: O_DIRECT refused on {d}; the limit is buffered", file=sys.stderr)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        t0 = time.perf_counter()
        off, chunk = 0, 8 << 20
        view = memoryview(mm)
        while off < n:
            off += os.pwritev(fd, [view[off:off + chunk]], off)
        os.fdatasync(fd)
        t_write = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)
        view.release()
    return t_copy, t_copy + t_write


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=128)
    ap.add_argument("--forward-ms", type=float, default=20.0)
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--lag", type=int, default=4, help="write-behind lag in steps (compared with 0)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--dir", default=None, help="directory on the disk to test (default: a temp dir)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    res: dict[str, list[float]] = {"copy": [], "copy+write": [], "lag0": [], f"lag{a.lag}": []}
    with tempfile.TemporaryDirectory(dir=a.dir) as base:
        for rep in range(a.reps):   # interleaved, so drift hits every setting alike
            c, cw = limits(a.blocks, base)
            res["copy"].append(c)
            res["copy+write"].append(cw)
            for lag in (0, a.lag):
                d = os.path.join(base, f"r{rep}-lag{lag}")
                res[f"lag{lag}"].append(run(lag, a.blocks, a.forward_ms / 1e3, a.decode_steps, d, rep))
    med = {k: statistics.median(v) * 1e3 for k, v in res.items()}
    mib = a.blocks * LAYERS * 2 * BT * KVH * HD * 2 / (1 << 20)
    if a.json:
        print(json.dumps({"mib": mib, "median_ms": med, "samples_ms": {k: [x * 1e3 for x in v] for k, v in res.items()}}))
        return
    print(f"store stall per prefill of {a.blocks} blocks ({mib:.0f} MiB), forward {a.forward_ms:.0f} ms, "
          f"{a.decode_steps} decode steps after, median of {a.reps}:")
    for k in res:
        print(f"  {k:<11} {med[k]:8.1f} ms   ({med[k] / med['copy']:.2f}x the copy alone)")


if __name__ == "__main__":
    sys.exit(main())
