"""Scheduler-side overhead of the kvtier connector per step, for a 10k-block lookup.

With `--blocks` (10,000) blocks resident in a tier, one request whose prefix is all of them goes
through the scheduler hooks vLLM calls in one step: `get_num_new_matched_tokens` (lookup + lease),
`update_state_after_alloc` (commit the lease, plan the load) and `build_connector_meta` (the plan
for the workers). Printed as µs per block, median over `--repeats`. The worker's report and the
request's end (which release the lease) run between repeats, untimed.

Drives `kvtier.connector.scheduler.KVTierScheduler` directly with a duck-typed request (what the
connector's hooks call after unpacking vLLM's objects); vLLM is not needed.

    python benchmarks/sched_overhead.py [--blocks 10000] [--repeats 21] [--tier cpu|nvme|both]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kvtier.connector.metadata import KVTierWorkerMeta  # noqa: E402
from kvtier.connector.scheduler import KVTierScheduler, SchedulerOptions  # noqa: E402
from kvtier.core.controller import TierController  # noqa: E402
from kvtier.policies import EVICTION  # noqa: E402
from kvtier.tiers.base import SlotTier  # noqa: E402

BT = 32
BB = 512 << 10


@dataclass
class Req:
    request_id: str
    block_hashes: list
    num_tokens: int


def keys(n: int) -> list[bytes]:
    return [i.to_bytes(8, "big") * 4 for i in range(n)]   # 32-byte hashes like vLLM's sha256


def build(tier: str, n: int, tmp: str) -> KVTierScheduler:
    cap = n + 64
    sfx = (0).to_bytes(4, "big")
    ks = [k + sfx for k in keys(n)]
    cpu = SlotTier("cpu", cap, BB, EVICTION.get("lru")(cap))
    tiers = [cpu]
    if tier in ("nvme", "both"):
        from kvtier.tiers.nvme_control import NvmeControl
        nv = NvmeControl("nvme", os.path.join(tmp, "nvme"), cap, BB, EVICTION.get("lru")(cap), {"model": "bench"})
        if nv.num_resident < n:
            slots = nv.allocate(ks)
            nv.commit_written(slots, [i for i in range(n)])
        tiers.append(nv)
    if tier in ("cpu", "both"):
        put = ks if tier == "cpu" else ks[: n // 2]   # both: first half CPU, second half NVMe
        cpu.commit(cpu.allocate(put))
    # promotion off: a repeat must find the same tiers (promotion would move NVMe hits to the CPU)
    return KVTierScheduler(TierController(tiers, block_tokens=BT), options=SchedulerOptions(store=False))


def run(tier: str, n: int, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        s = build(tier, n, tmp)
        hashes = keys(n)
        ids = list(range(1, n + 2))
        phases = {"get_num_new_matched_tokens": [], "update_state_after_alloc": [], "build_connector_meta": []}
        for i in range(repeats):
            r = Req(f"r{i}", hashes, n * BT + 1)
            t0 = time.perf_counter()
            got = s.lookup(r, 0)
            t1 = time.perf_counter()
            s.on_alloc(r, [ids], got)
            t2 = time.perf_counter()
            meta = s.build_meta([(r.request_id, n * BT + 1, [ids])])
            t3 = time.perf_counter()
            assert got == n * BT and sum(len(op.slots) for op in meta.loads) == n, (got, len(meta.loads))
            phases["get_num_new_matched_tokens"].append(t1 - t0)
            phases["update_state_after_alloc"].append(t2 - t1)
            phases["build_connector_meta"].append(t3 - t2)
            s.on_worker_meta(KVTierWorkerMeta(loaded={op.req_id: True for op in meta.loads}))
            s.on_finished(r.request_id)
        assert s.pinned_blocks() == 0
        for t in s.tiers:
            getattr(t, "close", lambda: None)()
    out = {k: round(statistics.median(v) / n * 1e6, 3) for k, v in phases.items()}
    tot = [a + b + c for a, b, c in zip(*phases.values())]
    out["total_us_per_block"] = round(statistics.median(tot) / n * 1e6, 3)
    out["total_ms_per_step"] = round(statistics.median(tot) * 1e3, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--tier", choices=["cpu", "nvme", "both", "all"], default="all")
    a = ap.parse_args()
    tiers = ["cpu", "nvme", "both"] if a.tier == "all" else [a.tier]
    res = {t: run(t, a.blocks, a.repeats) for t in tiers}
    print(f"scheduler overhead, {a.blocks} resident blocks hit in one step, µs per block (median of {a.repeats})")
    print(f"{'tier':<6}{'lookup':>10}{'alloc':>10}{'meta':>10}{'total':>10}{'ms/step':>10}")
    for t, r in res.items():
        print(f"{t:<6}{r['get_num_new_matched_tokens']:>10}{r['update_state_after_alloc']:>10}"
              f"{r['build_connector_meta']:>10}{r['total_us_per_block']:>10}{r['total_ms_per_step']:>10}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
