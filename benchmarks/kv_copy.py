"""Gather / scatter speed of the worker's copies between vLLM's KV and the CPU pool (no vLLM).

The CPU backend's layout (every layer a view of one buffer, `[blocks, heads, tokens, 2*head]`,
physical order = logical order): a store (KV -> pool slots, the gather) and a load (slots -> KV,
the scatter) of `--blocks` blocks, consecutive and scattered, in GB/s (median of `--repeat`).
`--layout nhd` measures a token-major layout (a GPU's, on CPU tensors: canonicalised per block).

    python benchmarks/kv_copy.py                    # 16 layers x 4 heads x 32 tokens x 128 float32
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvtier.connector.metadata import KVTierMetadata, LoadOp, StoreOp
from kvtier.connector.config import load_settings
from kvtier.connector.worker import KVTierWorker


def caches(layout: str, layers: int, blocks: int, heads: int, tokens: int, content: int) -> dict:
    if layout == "hnd":   # the CPU backend's: [L, B, H, N, C]
        raw = torch.randn(layers, blocks, heads, tokens, content)
        return {f"l{i}": raw[i] for i in range(layers)}
    raw = torch.randn(layers, blocks, tokens, heads, content)   # [L, B, N, H, C], viewed [B, H, N, C]
    return {f"l{i}": raw[i].permute(0, 2, 1, 3) for i in range(layers)}


def measure(layout: str, n: int, scattered: bool, repeat: int, args) -> dict:
    kv = caches(layout, args.layers, args.kv_blocks, args.heads, args.tokens, args.content)
    w = KVTierWorker(load_settings({"cpu_capacity_blocks": n, "pin": False}))
    w.register_kv_caches(kv)
    g = torch.Generator().manual_seed(0)
    if scattered:
        blocks = torch.randperm(args.kv_blocks, generator=g)[:n].tolist()
        slots = torch.randperm(n, generator=g).tolist()
    else:
        blocks, slots = list(range(7, 7 + n)), list(range(n))
    nbytes = n * w.layout.block_bytes
    st, ld = [], []
    for i in range(repeat):
        w.bind(KVTierMetadata(stores=[StoreOp(i, 0, slots, blocks)]))
        t0 = time.perf_counter()
        w.save()
        st.append(time.perf_counter() - t0)
        w.take_report()
        w.bind(KVTierMetadata(loads=[LoadOp(f"r{i}", 0, slots, blocks)]))
        t0 = time.perf_counter()
        w.start_load()
        ld.append(time.perf_counter() - t0)
        assert w.take_report().loaded == {f"r{i}": True}
    w.close()
    return {"layout": layout, "blocks": n, "scattered": scattered, "block_bytes": nbytes // n,
            "store_gbps": nbytes / statistics.median(st) / 1e9, "load_gbps": nbytes / statistics.median(ld) / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--content", type=int, default=128)
    ap.add_argument("--kv-blocks", type=int, default=512)
    ap.add_argument("--blocks", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--layout", choices=("hnd", "nhd"), action="append")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rows = [measure(lay, a.blocks, sc, a.repeat, a) for lay in (a.layout or ["hnd"]) for sc in (False, True)]
    if a.json:
        print(json.dumps(rows, indent=1))
        return
    print("| layout | blocks | order | store GB/s | load GB/s |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layout']} | {r['blocks']} x {r['block_bytes'] >> 10} KiB | "
              f"{'scattered' if r['scattered'] else 'consecutive'} | {r['store_gbps']:.2f} | {r['load_gbps']:.2f} |")


if __name__ == "__main__":
    main()
