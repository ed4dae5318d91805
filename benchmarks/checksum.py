"""Checksum candidates for the NVMe block tag, GB/s on one core, hot cache, 256 KiB - 2 MiB blocks.

    python benchmarks/checksum.py

xxh3_64 unkeyed (format 1), xxh3_64 / xxh3_128 seeded from the directory secret, the tier's
tag (seeded xxh3_64 over the payload + keyed BLAKE2b over the header: `nvme_block.BlockCodec`),
and keyed BLAKE2b over the whole payload.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import time

import xxhash

from kvtier.tiers.nvme_block import HEADER_BYTES, BlockCodec


def gbps(fn, buf: memoryview) -> float:
    n = max(8, (512 << 20) // len(buf))
    fn(buf)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(n):
            fn(buf)
        best = min(best, time.perf_counter() - t)
    return n * len(buf) / best / 1e9


def main() -> None:
    secret = os.urandom(32)
    seed = int.from_bytes(secret[:8], "little")
    codec = BlockCodec(secret, 1)
    hdr = memoryview(mmap.mmap(-1, HEADER_BYTES))
    key = os.urandom(36)
    fns = {
        "xxh3_64 unkeyed": lambda b: xxhash.xxh3_64_intdigest(b),
        "xxh3_64 seeded": lambda b: xxhash.xxh3_64_intdigest(b, seed),
        "xxh3_128 seeded": lambda b: xxhash.xxh3_128_intdigest(b, seed),
        "tier tag (seal)": lambda b: codec.seal(hdr, key, b),
        "blake2b keyed": lambda b: hashlib.blake2b(b, key=secret, digest_size=8).digest(),
    }
    print(f"{'block':>8}  " + "  ".join(f"{k:>16}" for k in fns))
    for size in (256 << 10, 512 << 10, 1 << 20, 2 << 20):
        buf = memoryview(os.urandom(size))
        print(f"{size >> 10:>5} KiB  " + "  ".join(f"{gbps(f, buf):>16.2f}" for f in fns.values()), flush=True)


if __name__ == "__main__":
    main()
