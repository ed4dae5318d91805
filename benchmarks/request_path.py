"""How many kvtier files one request crosses inside real vLLM (CPU build, one process).

Three requests through a tiny random Llama with a DRAM + NVMe stack: a store (a new prompt),
a DRAM load (the same prompt again; vLLM's prefix caching is off) and an NVMe load (the prompt
again after other prompts pushed it out of DRAM). For each, every call into a kvtier production
module is recorded (`sys.setprofile`, all threads); a *hop* is a distinct (caller file, callee
file) pair of kvtier modules, the caller being the nearest kvtier frame up the stack.

    python benchmarks/request_path.py [--show]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import vllm_util as U  # noqa: E402


def _roots() -> dict[str, str]:
    import kvtier
    import kvtier.connector
    import kvtier.policies
    import kvtier.tiers
    out = {}
    for name, mod in (("kvtier", kvtier), ("kvtier.connector", kvtier.connector),
                      ("kvtier.tiers", kvtier.tiers), ("kvtier.policies", kvtier.policies)):
        out[os.path.dirname(os.path.abspath(mod.__file__)) + os.sep] = name
    return out


class PathTracer:
    """Records kvtier files entered and file-to-file hops while active."""

    def __init__(self) -> None:
        self.roots = sorted(_roots().items(), key=lambda kv: -len(kv[0]))
        self.names: dict[str, str | None] = {}
        self.files: set[str] = set()
        self.hops: set[tuple[str, str]] = set()

    def name(self, filename: str) -> str | None:
        n = self.names.get(filename, "")
        if n == "":
            n = None
            for root, pkg in self.roots:
                if filename.startswith(root):
                    n = pkg + "/" + filename[len(root):]
                    break
            self.names[filename] = n
        return n

    def _prof(self, frame, event, arg):
        if event != "call":
            return
        callee = self.name(frame.f_code.co_filename)
        if callee is None:
            return
        self.files.add(callee)
        f = frame.f_back
        while f is not None:
            caller = self.name(f.f_code.co_filename)
            if caller is not None:
                if caller != callee:
                    self.hops.add((caller, callee))
                return
            f = f.f_back

    def __enter__(self):
        threading.setprofile(self._prof)
        sys.setprofile(self._prof)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)
        threading.setprofile(None)


def _sched(llm):
    import kvtier.connector as C
    return next(c for c in C.live_connectors("scheduler") if c.sched is not None).sched


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--show", action="store_true", help="list the files and hops")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    U.set_env()
    with tempfile.TemporaryDirectory() as tmp:
        model = U.build_tiny_llama(Path(tmp) / "llama")
        y = Path(tmp) / "stack.yaml"
        y.write_text(f"""
tiers:
  - {{name: cpu, kind: cpu, capacity_blocks: 8}}
  - {{name: nvme, kind: nvme, path: {Path(tmp) / 'nv'}, capacity_blocks: 64, io: posix}}
serving: {{nvme_write_lag_steps: 0}}
""")
        llm = U.make_llm(model, U.kvtier_config(config=str(y)))
        try:
            ps = U.prompts(4, 4, seed=11)
            U.generate(llm, [[5, 6, 7]], 2)   # warm-up: the first step's one-time work
            results = {}
            for phase in ("store", "DRAM load", "NVMe load"):
                if phase == "NVMe load":
                    for p in ps[1:]:
                        U.generate(llm, [p], 2)
                    U.run_steps(llm, 4)
                before = dict(_sched(llm).totals)
                with PathTracer() as t:
                    U.generate(llm, [ps[0]], 2)
                    if phase == "store":
                        U.run_steps(llm, 2)   # the copies down reported
                results[phase] = (t, U.tier_hits(before, dict(_sched(llm).totals)))
        finally:
            U.shutdown(llm)
    for phase, (t, hits) in results.items():
        pkgs = sorted({f.split("/")[0] for f in t.files})
        hit = ", ".join(f"{k} {v}" for k, v in hits.items() if v) or "none"
        print(f"{phase:10s} files {len(t.files):3d}  hops {len(t.hops):3d}  packages {len(pkgs)}"
              f"  (hit tokens: {hit})")
        if args.show:
            for f in sorted(t.files):
                print("   ", f)
            for a, b in sorted(t.hops):
                print("    ", a, "->", b)


if __name__ == "__main__":
    main()
