"""Cost of the eviction policies' own calls: time per block and memory per tracked block.

Method. `kvtier.offline.sim.simulate` is run once per policy with a recording proxy in front of the
policy: every call the tier makes (on_insert / on_hit / on_remove_many / take_victims / ...)
is logged with its arguments. The log is then replayed, `--repeat` times, directly against a
fresh instance of the policy (deterministic: the same calls get the same answers), timing only
those calls. Reported: median ns per block reference of the trace (all policy work divided by
the trace's block refs), and memory per tracked block = tracemalloc's traced bytes after the
replay (policy built and driven with tracing on; the keys themselves are allocated before
and shared with the tier, so they are not counted) divided by the capacity in blocks.

Admission policies (``--admissions``, e.g. ``second_hit``) are measured the same way: their
``admit`` / ``on_evict`` calls under ``vllm_lru`` eviction are recorded and replayed against a
fresh instance; their memory is divided by the capacity too.

    python benchmarks/policy_cost.py [--trace PATH] [--fraction 0.05] [--limit N] [--repeat 5] [--json]
                                     [--admissions second_hit] [--set eval]

`--set eval` measures on every generated workload shape and the bundled trace instead
(`kvtier.offline.compare.trace_set`): the cost of a policy depends on the traffic (blocks per request,
hit share), so the bar is checked on each shape, not one trace.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import tracemalloc

from kvtier.offline.compare import trace_set
from kvtier.policies import ADMISSION, EVICTION, AdmissionPolicy
from kvtier.offline.sim import simulate
from kvtier.offline.trace import default_trace, load_trace, make_keys, unique_blocks

POLICIES = ["vllm_lru", "lru", "arc", "s3fifo"]
LIMITS = {"ns_per_block": 1000.0, "bytes_per_block": 64.0}


class Recorder:
    """Forwards every call to `pol` and logs (method, args) with copies of list arguments."""

    def __init__(self, pol) -> None:
        self.pol, self.log = pol, []

    def __getattr__(self, name):
        f = getattr(self.pol, name)
        if not callable(f) or name.startswith("_"):
            return f

        def call(*a):
            if name == "take_victims":  # the tier's live pin array: replayed as "nothing pinned"
                self.log.append((name, (a[0], None)))
            else:
                self.log.append((name, tuple(list(x) if isinstance(x, (list, tuple)) else x for x in a)))
            r = f(*a)
            if name == "victims":
                r = list(r)
                self.log[-1] = ("victims_list", self.log[-1][1])
                return iter(r)
            return r
        return call


def record(reqs, keys, name: str, cap: int) -> list:
    """The policy calls simulate() makes for `name` at `cap` blocks."""
    real = EVICTION.get(name)
    holder = {}

    def build(capacity, **params):
        rec = Recorder(real(capacity, **params))
        holder["rec"] = rec
        return rec
    EVICTION.classes["__rec__"] = build  # for this call: the controller builds its policy by name
    try:
        simulate(reqs, cap, "__rec__", keys=keys)
    finally:
        del EVICTION.classes["__rec__"]
    log = holder["rec"].log
    return log


def replay_log(pol, log, cap: int) -> None:
    zeros = [0] * cap
    for name, args in log:
        if name == "take_victims":
            pol.take_victims(args[0], zeros)
        elif name == "victims_list":
            for _ in pol.victims(*args):
                pass
        else:
            getattr(pol, name)(*args)


def measure(reqs, keys, name: str, cap: int, repeat: int) -> dict:
    log = record(reqs, keys, name, cap)
    refs = sum(len(k) for k in keys)
    times = []
    for _ in range(repeat):
        pol = EVICTION.get(name)(cap)
        gc.collect()
        gc.disable()
        t0 = time.process_time()     # CPU time of this process: the machine may be shared
        replay_log(pol, log, cap)
        times.append(time.process_time() - t0)
        gc.enable()
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    pol = EVICTION.get(name)(cap)
    replay_log(pol, log, cap)
    gc.collect()
    mem = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    t = statistics.median(times)
    return {"policy": name, "capacity_blocks": cap, "block_refs": refs, "calls": len(log),
            "seconds_median": t, "ns_per_block": 1e9 * t / refs, "bytes": mem, "bytes_per_block": mem / cap}


def measure_admission(reqs, keys, name: str, cap: int, repeat: int) -> dict:
    """Time and memory of admission policy `name`'s own calls (under vllm_lru eviction)."""
    real = ADMISSION.get(name)
    log: list = []
    holder = {}

    class Rec(real):  # logs its calls (a subclass, so the controller sees the real hooks)
        def __init__(self, **params):
            super().__init__(**params)
            holder["params"] = params

        def admit(self, keys, info=None):
            log.append(("admit", (list(keys), info)))
            return super().admit(keys, info)

        if real.on_evict is not AdmissionPolicy.on_evict:
            def on_evict(self, key):
                log.append(("on_evict", (key,)))
                return super().on_evict(key)
    Rec.name = "__rec__"
    ADMISSION.classes["__rec__"] = Rec
    try:
        simulate(reqs, cap, "vllm_lru", "__rec__", keys=keys)
    finally:
        del ADMISSION.classes["__rec__"]
    params = holder["params"]
    refs = sum(len(k) for k in keys)
    times = []
    for _ in range(repeat):
        pol = real(**params)
        gc.collect()
        gc.disable()
        t0 = time.process_time()
        for m, args in log:
            getattr(pol, m)(*args)
        times.append(time.process_time() - t0)
        gc.enable()
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    pol = real(**params)
    for m, args in log:
        getattr(pol, m)(*args)
    gc.collect()
    mem = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    t = statistics.median(times)
    return {"policy": f"{name} (admission)", "capacity_blocks": cap, "block_refs": refs, "calls": len(log),
            "seconds_median": t, "ns_per_block": 1e9 * t / refs, "bytes": mem, "bytes_per_block": mem / cap}


def measure_all(reqs, a) -> tuple[int, list[dict]]:
    """(capacity at a.fraction of the unique blocks, a row per --policies then per --admissions)."""
    keys = make_keys(reqs)
    cap = max(1, int(a.fraction * unique_blocks(reqs)))
    rows = [measure(reqs, keys, n, cap, a.repeat) for n in a.policies.split(",") if n]
    rows += [measure_admission(reqs, keys, n, cap, a.repeat) for n in a.admissions.split(",") if n]
    return cap, rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(default_trace()))
    ap.add_argument("--fraction", type=float, default=0.05)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--admissions", default="", help="admission policies to measure too (comma-separated)")
    ap.add_argument("--set", choices=["eval"], default=None,
                    help="measure on every trace of this set instead of --trace")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.set:
        return _main_set(a)
    reqs = load_trace(a.trace, limit=a.limit)
    cap, rows = measure_all(reqs, a)
    if a.json:
        print(json.dumps({"trace": a.trace, "limits": LIMITS, "rows": rows}))
        return 0
    print(f"{a.trace}: {len(reqs)} requests, {rows[0]['block_refs']} block refs, capacity {cap} blocks "
          f"({a.fraction:g} of unique); median of {a.repeat}; limits {LIMITS['ns_per_block']:.0f} ns/block, "
          f"{LIMITS['bytes_per_block']:.0f} B/tracked block\n")
    print("| policy | ns per block ref | bytes per tracked block |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['policy']} | {r['ns_per_block']:.0f} | {r['bytes_per_block']:.0f} |")
    return 0


def _main_set(a) -> int:
    """One row per policy, one column per trace of the set: ns per block ref / bytes per block."""
    per_trace = []
    for tname, reqs in trace_set(a.set):
        cap, rows = measure_all(reqs, a)
        per_trace.append({"trace": tname, "capacity_blocks": cap, "requests": len(reqs),
                          "blocks_per_request": rows[0]["block_refs"] / max(1, len(reqs)), "rows": rows})
        print(f"{tname}: {cap} blocks", file=sys.stderr, flush=True)
    if a.json:
        print(json.dumps({"set": a.set, "fraction": a.fraction, "limits": LIMITS, "traces": per_trace}))
        return 0
    print(f"set {a.set}, capacity {a.fraction:g} of each trace's unique blocks; median of {a.repeat}; "
          f"cell: ns per block ref / bytes per tracked block; limits {LIMITS['ns_per_block']:.0f} ns, "
          f"{LIMITS['bytes_per_block']:.0f} B\n")
    print("| policy | " + " | ".join(f"{t['trace']} ({t['blocks_per_request']:.0f} blk/req, {t['capacity_blocks']} cap)"
                                      for t in per_trace) + " | worst |")
    print("|---|" + "---|" * (len(per_trace) + 1))
    for i, r0 in enumerate(per_trace[0]["rows"]):
        cells = [t["rows"][i] for t in per_trace]
        worst_ns = max(c["ns_per_block"] for c in cells)
        worst_b = max(c["bytes_per_block"] for c in cells)
        print(f"| {r0['policy']} | " + " | ".join(f"{c['ns_per_block']:.0f} / {c['bytes_per_block']:.0f}" for c in cells)
              + f" | {worst_ns:.0f} / {worst_b:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
