"""Host time the worker's step hooks take on the device-copier path, on CPU.

The worker (`KVTierWorker`, no vLLM) drives vLLM's KV in a realistic layout (token-major NHD,
bf16, 32 layers x 8 KV heads x 128 dims, 16-token blocks: 2 MiB per block) through the device
copier with `ThreadStreams`, a `device_copy.Streams` whose side stream is a thread that runs the
queued copies later, as a GPU's copy engine does: a hook that waits for a copy on the host
(`sync`) pays the copy's time, one that only queues it does not. The compute stream's waits cost
the host nothing (a GPU's), and the "forward" (`--forward-ms` of sleep, the host free while the
GPU computes) never touches the blocks in flight. Each step loads `--blocks` blocks
(`start_load_kv`, then `wait_for_layer_load` for every layer), stores `--blocks` others
(`wait_for_save`) and takes the report (`build_connector_worker_meta`, `get_block_ids_with_load_errors`).
The CPU backend's own path (row copies on the host, no streams) runs as the control.

Each tree given with `--tree NAME=DIR` (a checkout; the default is this one) runs in its own
process, interleaved ABBA, so two versions are compared in one run:

    git archive main | (mkdir -p /tmp/base && tar -x -C /tmp/base)
    python benchmarks/hook_time.py --tree main=/tmp/base --tree this=.   # 4+4 blocks a step, 40 ms forward
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

LAYERS, BLOCK_TOKENS, KV_HEADS, HEAD_DIM = 32, 16, 8, 128


class ThreadStreams:
    """`Streams` whose side stream is a thread: copies run later, in order; events are flags."""

    def __init__(self) -> None:
        self.q: queue.Queue = queue.Queue()
        self.cur = "compute"
        self.syncs = 0
        self.t = threading.Thread(target=self._loop, daemon=True)
        self.t.start()

    def _loop(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            fn, args = item
            fn(*args)

    def fence(self) -> None:          # the host ran the "forward" already: nothing to wait for
        pass

    def side(self):
        import contextlib

        @contextlib.contextmanager
        def cm():
            prev, self.cur = self.cur, "side"
            try:
                yield
            finally:
                self.cur = prev
        return cm()

    def run(self, fn, *args):
        if self.cur == "side":
            self.q.put((fn, args))
        else:
            fn(*args)

    def record(self) -> threading.Event:
        ev = threading.Event()
        self.q.put((ev.set, ()))
        return ev

    def compute_wait(self, event) -> None:  # a GPU's compute stream waits; the host does not
        pass

    def sync(self, event) -> None:
        self.syncs += 1
        event.wait()

    def query(self, event) -> bool:
        return event.is_set()

    def close(self) -> None:
        self.q.put(None)
        self.t.join()


def child(args) -> dict:
    import torch
    torch.set_num_threads(1)   # the forward's team is not what is measured; keep the copier's thread apart
    from kvtier.connector.metadata import KVTierMetadata, LoadOp, StoreOp
    from kvtier.connector.worker import KVTierWorker
    nb, k, slots = 4 * args.blocks + 8, args.blocks, 4 * args.blocks
    out = {}
    for path in args.paths.split(","):
        g = torch.Generator().manual_seed(0)
        phys = torch.randint(-100, 100, (LAYERS, nb, BLOCK_TOKENS, 2 * KV_HEADS, HEAD_DIM), generator=g,
                             dtype=torch.int16).view(torch.bfloat16)
        kv = {f"model.layers.{i}.self_attn.attn": phys[i].view(nb, BLOCK_TOKENS, 2 * KV_HEADS, HEAD_DIM)
              .permute(0, 2, 1, 3) for i in range(LAYERS)}
        streams = ThreadStreams() if path == "device" else None
        w = _worker(KVTierWorker, slots, streams)
        w.register_kv_caches(kv)
        names = list(kv)
        hooks: dict[str, list[float]] = {"start_load": [], "layer_waits": [], "save": [], "report": [],
                                         "total": []}
        for step in range(args.warmup + args.steps):
            s0 = (step * k) % slots
            ld = [(s0 + i) % slots for i in range(k)]
            st = [(s0 + k + i) % slots for i in range(k)]
            meta = KVTierMetadata(loads=[LoadOp(f"r{step}", 0, ld, list(range(k)))],
                                  stores=[StoreOp(step, 0, st, list(range(2 * k, 3 * k)))])
            w.bind(meta)
            t0 = time.perf_counter()
            w.start_load()
            t1 = time.perf_counter()
            for n in names:
                w.wait_layer(n)
            t2 = time.perf_counter()
            time.sleep(args.forward_ms / 1e3)
            t3 = time.perf_counter()
            w.save()
            t4 = time.perf_counter()
            w.take_report()
            w.take_load_errors()
            t5 = time.perf_counter()
            w.bind(None)
            if step >= args.warmup:
                for key, v in (("start_load", t1 - t0), ("layer_waits", t2 - t1), ("save", t4 - t3),
                               ("report", t5 - t4), ("total", (t2 - t0) + (t5 - t3))):
                    hooks[key].append(v)
        w.close()
        if streams is not None:
            streams.close()
        out[path] = {key: statistics.median(v) * 1e3 for key, v in hooks.items()}
    return out


def _package(tree: Path, tmp: Path) -> Path:
    """A directory whose `kvtier` is `tree`'s, as pyproject maps it (by symlinks)."""
    pkg = tmp / "kvtier"
    pkg.mkdir(parents=True)
    for f in (tree / "kvtier").iterdir():
        (pkg / f.name).symlink_to(f)
    for d in ("tiers", "policies", "connector", "configs"):
        (pkg / d).symlink_to(tree / d)
    return tmp


def _worker(cls, slots: int, streams):
    """A worker of `slots` unpinned DRAM slots, through whichever constructor the tree has."""
    import inspect
    if next(iter(inspect.signature(cls).parameters)) == "cfg":
        from kvtier.connector.config import load_settings
        return cls(load_settings({"cpu_capacity_blocks": slots, "pin": False}), copy_streams=streams)
    return cls(lambda bb: slots, pin=False, copy_streams=streams)   # trees before the settings constructor


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", default=[], help="NAME=DIR, a checkout to measure (repeatable)")
    ap.add_argument("--blocks", type=int, default=4, help="blocks loaded and blocks stored per step (2 MiB each)")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--forward-ms", type=float, default=40.0)
    ap.add_argument("--rounds", type=int, default=2, help="ABBA rounds over the trees")
    ap.add_argument("--paths", default="device,cpu", help="which paths to run: device, cpu or both")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return 0
    trees = [t.split("=", 1) for t in (args.tree or [f"this={Path(__file__).resolve().parents[1]}"])]
    runs: dict[str, list[dict]] = {name: [] for name, _ in trees}
    with tempfile.TemporaryDirectory(prefix="hook_time_") as tmp:
        envs = {}
        for name, d in trees:
            p = _package(Path(d).resolve(), Path(tmp) / name)
            envs[name] = dict(os.environ, PYTHONPATH=f"{p}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        order = [n for n, _ in trees]
        for r in range(args.rounds):
            for name in (order if r % 2 == 0 else order[::-1]):
                cmd = [sys.executable, __file__, "--child", "--blocks", str(args.blocks), "--steps", str(args.steps),
                       "--warmup", str(args.warmup), "--forward-ms", str(args.forward_ms), "--paths", args.paths]
                res = subprocess.run(cmd, env=envs[name], capture_output=True, text=True, cwd=tmp)
                if res.returncode:
                    print(res.stderr, file=sys.stderr)
                    return 1
                runs[name].append(json.loads(res.stdout.strip().splitlines()[-1]))
    print(f"{args.blocks} blocks loaded + {args.blocks} stored per step (2 MiB each), {args.forward_ms} ms forward, "
          f"median ms per step over {args.steps} steps, {args.rounds} runs per tree (ABBA)")
    print(f"{'tree':<8} {'path':<7} {'start_load':>10} {'layer_waits':>11} {'save':>8} {'report':>8} {'total':>8}")
    for name, rs in runs.items():
        print(f"{name:<8} totals per run: " + "; ".join(
            ", ".join(f"{p} {r[p]['total']:.2f}" for p in r) for r in rs))
        for path in args.paths.split(","):
            med = {k: statistics.median(r[path][k] for r in rs) for k in rs[0][path]}
            print(f"{name:<8} {path:<7} {med['start_load']:>10.3f} {med['layer_waits']:>11.3f} {med['save']:>8.3f} "
                  f"{med['report']:>8.3f} {med['total']:>8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
