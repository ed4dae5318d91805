"""What a step asks of a GPU: copy launches, events and the compute stream's waits of the worker's
device copies (issue 36), counted on CPU through `probes.DeferredStreams(count=True)` (a launch:
an aten op that is neither a view nor an allocation, a kernel or a memcpy on CUDA).

    python benchmarks/gpu/launches.py [--json] [--layers 80]

An 80-layer KV (vLLM's per-layer NHD views, bf16, 512 B per layer and block) and a worker on it:
- 1,000 blocks of 1,000 one-block requests stored in one step (consecutive DRAM slots, as a fresh
  pool hands them out), then loaded: launches per layer each way; `..._one_request`: the same
  blocks as one request; `..._scattered_rows`: every slot apart (a store's chunk of more runs of
  rows than layers takes one device->host memcpy into a pinned bounce ring that the host scatters
  from; a load stages its rows layer-major on the host: no memcpy per run either way);
- one step of 16 one-block requests loading and 16 storing (slots apart), and of 1 and 1:
  every launch of the step (`launches_16_requests`, `launches_1_request`), the events recorded, the
  compute stream's waits on store events (`compute_waits_on_stores_per_step`) and the share of
  the step's load bytes queued before layer 0's event (`layer0_wait_fraction`: what the
  forward's first layer waits for; 1/layers when each layer waits for its own bytes only).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import probes  # noqa: E402
from kvtier.connector.config import load_settings  # noqa: E402
from kvtier.connector.metadata import KVTierMetadata, LoadOp, StoreOp  # noqa: E402
from kvtier.connector.worker import KVTierWorker  # noqa: E402

BLOCKS = 1000
SLOTS = 2048


class Bench:
    """A worker over an `layers`-layer KV copying through counting `DeferredStreams`."""

    def __init__(self, layers: int) -> None:
        self.st = probes.DeferredStreams(count=True)
        self.kv = probes.views("LBNHC", layers, SLOTS + 64, 1, 16, 16, torch.bfloat16, "cpu")
        self.w = KVTierWorker(load_settings({"cpu_capacity_blocks": SLOTS, "pin": False}), copy_streams=self.st)
        self.w.register_kv_caches(self.kv)
        self.layers = layers

    def step(self, loads: list[LoadOp], stores: list[StoreOp]) -> dict:
        """One step's hooks (load, every layer's wait, save, report); every copy then run."""
        st = self.st
        st.drain()
        s0, w0, e0 = len(st.q["side"]), len(st.waited), st.events
        self.w.bind(KVTierMetadata(loads=loads, stores=stores))
        self.w.start_load()
        s1 = len(st.q["side"])
        for name in self.kv:
            self.w.wait_layer(name)
        w1 = len(st.waited)
        self.w.save()
        s2, w2 = len(st.q["side"]), len(st.waited)
        self.w.take_report()
        st.drain()
        self.w.take_report()
        n, b = st.item_launches["side"], st.item_bytes["side"]
        layer0 = st.waited[w0] if w1 > w0 else s0
        load_bytes = sum(b[s0:s1])
        return {"load_launches": sum(n[s0:s1]), "store_launches": sum(n[s1:s2]),
                "events": st.events - e0, "compute_waits_on_stores": w2 - w1,
                "layer0_wait_fraction": sum(b[s0:layer0]) / load_bytes if load_bytes else 0.0}

    def close(self) -> None:
        self.w.close()


def measure(layers: int = 80) -> dict:
    b = Bench(layers)
    try:
        g = torch.Generator().manual_seed(0)
        blocks = torch.randperm(SLOTS, generator=g)[:BLOCKS].tolist()
        dst = torch.randperm(SLOTS, generator=g)[:BLOCKS].tolist()
        out: dict = {"layers": layers}
        apart = list(range(0, 2 * BLOCKS, 2))
        for name, slots, requests in (("", list(range(BLOCKS)), BLOCKS), ("_one_request", list(range(BLOCKS)), 1),
                                      ("_scattered_rows", apart, BLOCKS)):
            size = BLOCKS // requests
            parts = [(i, slots[i:i + size], blocks[i:i + size], dst[i:i + size]) for i in range(0, BLOCKS, size)]
            st = b.step([], [StoreOp(1 + i, 0, sl, bl) for i, sl, bl, _ in parts])
            ld = b.step([LoadOp(f"r{i}", 0, sl, d) for i, sl, _, d in parts], [])
            out[f"store_launches_per_layer_1000_blocks{name}"] = round(st["store_launches"] / layers, 2)
            out[f"load_launches_per_layer_1000_blocks{name}"] = round(ld["load_launches"] / layers, 2)
        for n in (16, 1):
            loads = [LoadOp(f"l{i}", 0, [3 * i], [blocks[i]]) for i in range(n)]
            stores = [StoreOp(10 + i, 0, [100 + 3 * i], [dst[i]]) for i in range(n)]
            r = b.step(loads, stores)
            key = "16_requests" if n == 16 else "1_request"
            out[f"launches_{key}"] = r["load_launches"] + r["store_launches"]
            out[f"load_launches_{key}"] = r["load_launches"]
            out[f"store_launches_{key}"] = r["store_launches"]
            out[f"events_{key}"] = r["events"]
            if n == 16:
                out["compute_waits_on_stores_per_step"] = r["compute_waits_on_stores"]
                out["layer0_wait_fraction"] = round(r["layer0_wait_fraction"], 3)
        return out
    finally:
        b.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="one JSON line")
    ap.add_argument("--layers", type=int, default=80)
    a = ap.parse_args()
    r = measure(a.layers)
    if a.json:
        print(json.dumps(r), flush=True)
    else:
        for k, v in r.items():
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
