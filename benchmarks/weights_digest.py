"""The first-start cost of naming a model by its whole weights: xxh3-128 over every byte.

    python benchmarks/weights_digest.py [--gib 2] [--dir DIR] [--reps 3]

Writes a model directory (config.json + one weight file of --gib GiB) under --dir (default: a
temporary directory on the disk of the current directory), then, --reps times each (medians):
- cold: the file's page cache dropped (posix_fadvise DONTNEED after fsync) and digested, no cache;
- read-only cold: the same read without hashing (the disk's bound through this read loop);
- hot: digested again with the file in the page cache;
- restart: digested through the per-file digest cache (what a restart costs).
Prints GB/s and seconds; checks the dropped cache is really cold (cold slower than hot, else says so).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from kvtier.core.identity import DigestStats, weights_digest


def drop(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_only(path: str) -> float:
    buf = bytearray(8 << 20)
    fd = os.open(path, os.O_RDONLY)
    t = time.perf_counter()
    try:
        while os.readv(fd, [buf]):
            pass
    finally:
        os.close(fd)
    return time.perf_counter() - t


def digest_s(model: str, data_dir: str | None) -> tuple[float, DigestStats]:
    st = DigestStats()
    t = time.perf_counter()
    weights_digest(model, data_dir, st)
    return time.perf_counter() - t, st


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=a.dir or ".", prefix="kvtier-digest-bench-") as d:
        model = os.path.join(d, "model")
        os.mkdir(model)
        with open(os.path.join(model, "config.json"), "w") as f:
            f.write('{"hidden_size": 8192}')
        w = os.path.join(model, "model.safetensors")
        size = int(a.gib * (1 << 30))
        chunk = os.urandom(64 << 20)
        with open(w, "wb") as f:
            left = size
            while left > 0:
                left -= f.write(chunk[:left])
        res: dict[str, list[float]] = {"cold": [], "read-only cold": [], "hot": [], "restart": []}
        for _ in range(a.reps):
            drop(w)
            res["cold"].append(digest_s(model, None)[0])
            drop(w)
            res["read-only cold"].append(read_only(w))
            digest_s(model, None)
            res["hot"].append(digest_s(model, None)[0])
            cache = os.path.join(d, "data")
            digest_s(model, cache)                     # fills the cache
            s, st = digest_s(model, cache)
            assert st.hashed == 0 and st.bytes == 0
            res["restart"].append(s)
        print(f"weights digest, one file of {size / 1e9:.2f} GB, median of {a.reps} (host: {os.cpu_count()} cpus)")
        for k, v in res.items():
            m = statistics.median(v)
            rate = f"{size / m / 1e9:6.2f} GB/s" if k != "restart" else "  (no byte read)"
            print(f"  {k:15s} {m:8.3f} s  {rate}   runs {', '.join(f'{x:.3f}' for x in v)}")
        if statistics.median(res["cold"]) <= statistics.median(res["hot"]) * 1.1:
            print("  note: cold is not slower than hot: the page cache was probably not dropped "
                  "(the figures are hot)")


if __name__ == "__main__":
    main()
