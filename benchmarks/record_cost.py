"""What recording the traffic (`serving.record_trace`) costs the scheduler's step.

One request at a time goes through the scheduler hooks vLLM calls for it (lookup, alloc, the
step's metadata, the workers' report, `request_finished`) on a CPU tier holding its prefix; the
time of those hooks per request is compared with recording off and on, in alternating rounds
(`--rounds`), so both see the same machine. With recording on, the writer thread formats and
writes every line meanwhile (it shares the interpreter: its cost to the step is in the figure).
Printed: the median µs per request of each mode, their ratio, the hook `request_finished` alone,
and the lines the writer wrote (every request: nothing dropped).

Drives `kvtier.connector.scheduler.KVTierScheduler` directly (vLLM is not needed).

    python benchmarks/record_cost.py [--requests 2000] [--blocks 64] [--rounds 7]
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
from kvtier.connector.recorder import TraceRecorder  # noqa: E402
from kvtier.connector.scheduler import KVTierScheduler, SchedulerOptions  # noqa: E402
from kvtier.core.controller import TierController  # noqa: E402
from kvtier.policies import EVICTION  # noqa: E402
from kvtier.tiers.base import SlotTier  # noqa: E402

BT = 32
BB = 64 << 10


@dataclass
class Req:
    request_id: str
    block_hashes: list
    num_tokens: int
    num_prompt_tokens: int
    num_output_tokens: int
    arrival_time: float


def build(n_prefix: int, blocks: int) -> tuple[KVTierScheduler, list[list[bytes]]]:
    """A scheduler over one CPU tier holding `n_prefix` distinct prefixes of `blocks` blocks."""
    prefixes = [[(p * blocks + i).to_bytes(8, "big") * 4 for i in range(blocks)] for p in range(n_prefix)]
    cap = n_prefix * blocks + 64
    cpu = SlotTier("cpu", cap, BB, EVICTION.get("lru")(cap))
    sfx = (0).to_bytes(4, "big")
    cpu.commit(cpu.allocate([k + sfx for ks in prefixes for k in ks]))
    return KVTierScheduler(TierController([cpu], block_tokens=BT), options=SchedulerOptions(store=False)), prefixes


def one_round(s: KVTierScheduler, prefixes: list[list[bytes]], requests: int, tag: str) -> tuple[list, list]:
    per_req, finished = [], []
    blocks = len(prefixes[0])
    ids = list(range(1, blocks + 2))
    n_tok = blocks * BT + 1
    for i in range(requests):
        r = Req(f"{tag}{i}", prefixes[i % len(prefixes)], n_tok, n_tok, 16, time.time())
        t0 = time.perf_counter()
        got = s.lookup(r, 0)
        assert got == blocks * BT, got     # every block a hit: the hooks do their whole work
        s.on_alloc(r, [ids], got)
        meta = s.build_meta([(r.request_id, n_tok, [ids])])
        s.on_worker_meta(KVTierWorkerMeta(loaded={op.req_id: True for op in meta.loads}))
        t1 = time.perf_counter()
        s.on_finished(r.request_id)
        t2 = time.perf_counter()
        per_req.append(t2 - t0)
        finished.append(t2 - t1)
    return per_req, finished


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=2000, help="requests per round and mode")
    ap.add_argument("--blocks", type=int, default=64, help="full blocks per prompt (32 tokens each)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    s, prefixes = build(64, a.blocks)
    times: dict[str, list[float]] = {"off": [], "on": []}
    fin: dict[str, list[float]] = {"off": [], "on": []}
    ratios = []
    written = 0
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.jsonl")
        for rnd in range(a.rounds):
            med = {}
            for mode in (("off", "on") if rnd % 2 == 0 else ("on", "off")):
                rec = None
                if mode == "on":
                    counts: dict[str, int] = {}
                    rec = TraceRecorder(path, BT, count=lambda k, v=1: counts.__setitem__(k, counts.get(k, 0) + v))
                s.recorder = rec
                per_req, f = one_round(s, prefixes, a.requests, f"{mode}{rnd}-")
                if rec is not None:
                    rec.close(timeout_s=60)
                    s.recorder = None
                    written += counts.get("recorded_requests", 0)
                    if counts.get("record_dropped_requests", 0):
                        raise SystemExit(f"record_cost: {counts['record_dropped_requests']} requests dropped")
                times[mode] += per_req
                fin[mode] += f
                med[mode] = statistics.median(per_req)
            ratios.append(med["on"] / med["off"])
        with open(path, "rb") as fh:
            lines = sum(1 for _ in fh)
    res = {"requests_per_mode": a.requests * a.rounds, "blocks_per_request": a.blocks,
           "us_per_request_off": round(statistics.median(times["off"]) * 1e6, 1),
           "us_per_request_on": round(statistics.median(times["on"]) * 1e6, 1),
           "ratio_on_off_median_of_rounds": round(statistics.median(ratios), 3),
           "ratio_min_max": [round(min(ratios), 3), round(max(ratios), 3)],
           "request_finished_us_off": round(statistics.median(fin["off"]) * 1e6, 1),
           "request_finished_us_on": round(statistics.median(fin["on"]) * 1e6, 1),
           "lines_written": lines, "recorded_requests": written}
    if lines != a.requests * a.rounds:
        raise SystemExit(f"record_cost: {lines} lines written for {a.requests * a.rounds} requests")
    if a.json:
        print(json.dumps(res))
        return
    print(f"scheduler hooks per request ({a.blocks} blocks hit from DRAM), median of {res['requests_per_mode']} "
          f"requests per mode, {a.rounds} alternating rounds")
    print(f"  recording off: {res['us_per_request_off']} µs   on: {res['us_per_request_on']} µs   "
          f"on/off {res['ratio_on_off_median_of_rounds']} (rounds {res['ratio_min_max'][0]}-{res['ratio_min_max'][1]})")
    print(f"  request_finished alone: {res['request_finished_us_off']} µs off, {res['request_finished_us_on']} µs on")
    print(f"  lines written: {lines} (every request)")


if __name__ == "__main__":
    main()
