"""How far does knowing *whether* a block comes back get an eviction policy? (issue 12 bound)

An oracle admission that sees the future admits a block only if the trace references it again
(``--horizon`` seconds: only if it comes back within that many seconds). The eviction order
stays online (``--policies``). Gap closed against ``vllm_lru`` -> Belady (ties deepest-first) as
in ``policy_table.py``. If a policy with this oracle stays below half the gap, no admission
rule can bring it there: the rest of Belady's advantage is knowing *when* blocks come back.
The oracle exists only in this script (it is not a policy anyone can deploy).

    python benchmarks/policy_oracle.py [--set tune|eval] [--trace PATH ...] [--policies vllm_lru,nextuse]
                                       [--horizon inf,120]
"""

from __future__ import annotations

import argparse
import bisect
import math
import sys
import time
from typing import Sequence

from kvtier.belady import belady
from kvtier.compare import FRACTIONS, gap_closed, trace_set
from kvtier.policies import ADMISSION, AdmissionPolicy, RequestInfo
from kvtier.sim import make_keys, simulate
from kvtier.trace import unique_blocks

_FUTURE: dict = {}


class FutureReuse(AdmissionPolicy):
    """Admit a block iff it is referenced again (within `horizon_s`): reads the trace's future."""

    name = "oracle_reuse"

    def __init__(self, horizon_s: float = math.inf, **params) -> None:
        super().__init__(**params)
        self.horizon = horizon_s

    def admit(self, keys: Sequence[bytes], info: RequestInfo = RequestInfo()) -> list[bool]:
        i = _FUTURE["index"][id(info.keys)]          # the simulator passes one keys list per request
        occ, ts = _FUTURE["occ"], _FUTURE["ts"]
        out = []
        for k in keys:
            o = occ[k]
            j = bisect.bisect_right(o, i)
            out.append(j < len(o) and ts[o[j]] - ts[i] <= self.horizon)
        return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", choices=["eval", "tune"], default="tune")
    ap.add_argument("--trace", action="append", default=[])
    ap.add_argument("--policies", default="vllm_lru,nextuse")
    ap.add_argument("--horizon", default="inf,120", help="seconds, comma-separated; inf = ever")
    a = ap.parse_args(argv)
    ADMISSION.register(FutureReuse)
    pols = a.policies.split(",")
    hs = [float(h) for h in a.horizon.split(",")]
    cols = [(p, h) for p in pols for h in hs]
    print("| trace | cap | vllm_lru | belady | " + " | ".join(f"{p} + oracle {h:g} s" for p, h in cols) + " |")
    print("|---" * (4 + len(cols)) + "|")
    t0 = time.time()
    for name, reqs in trace_set(a.set, a.trace):
        keys = make_keys(reqs)
        occ: dict[bytes, list[int]] = {}
        for i, ks in enumerate(keys):
            for k in ks:
                occ.setdefault(k, []).append(i)
        _FUTURE.update(index={id(ks): i for i, ks in enumerate(keys)}, occ=occ,
                       ts=[r.timestamp / 1000.0 for r in reqs])
        u = unique_blocks(reqs)
        for f in FRACTIONS:
            cap = max(1, int(f * u))
            base = simulate(reqs, cap, "vllm_lru", keys=keys)["hit_ratio"]
            best = belady(reqs, cap)["hit_ratio"]
            cells = []
            for p, h in cols:
                r = simulate(reqs, cap, p, FutureReuse.name, admission_params={"horizon_s": h}, keys=keys)["hit_ratio"]
                g = gap_closed(r, base, best)
                cells.append(f"{100 * r:.1f}% ({'-' if g is None else f'{100 * g:+.0f}%'})")
            print(f"| {name} | {100 * f:g}% | {100 * base:.1f}% | {100 * best:.1f}% | " + " | ".join(cells) + " |",
                  flush=True)
    print(f"\n({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
