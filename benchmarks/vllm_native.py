"""vLLM's native offloading with vLLM's `fs` tier vs kvtier's NVMe tier below the CPU primary
tier, side by side in one run, through vLLM's real `TieringOffloadingManager` (scheduler side, no
GPU: tests/native_util.py fills the primary tier's shared memory as vLLM's worker does).

Per backend and repeat: a deployment stores `--chunks` chunks (requests of `--batch` chunks, each
cascaded to the tier; timed until every cascade finished), shuts down; a fresh deployment on the
same directory (a restart) loads them all back through lookups, promotions and the worker's read
(timed), and checks every byte. Then what each does with damage:
- a flipped byte in one stored chunk: served (the bytes differ) or a miss (counted);
- kill -9 of a process storing in a loop: how many of the chunks it reported stored a restart
  serves, and whether each is byte-exact.

    python benchmarks/vllm_native.py                    # 256 chunks x 512 KiB, 3 repeats
    python benchmarks/vllm_native.py --dir /mnt/nvme/x  # on another file system
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from native_util import BLOCKS_PER_CHUNK, Deployment, model_dir, offload_key, payload  # noqa: E402


def tier_cfg(backend: str, path: str) -> dict:
    if backend == "fs":
        return {"type": "fs", "root_dir": path, "n_read_threads": 4, "n_write_threads": 4}
    return {"type": "KvtierNvmeTier", "module_path": "kvtier.vllm", "path": path, "capacity_blocks": 4096,
            "io_threads": 4}


def data(n: int, nbytes: int, salt: bytes):
    return [offload_key(i, salt) for i in range(n)], [payload(i, nbytes, salt) for i in range(n)]


def store_all(dep: Deployment, keys, datas, batch: int) -> float:
    t0 = time.perf_counter()
    for i in range(0, len(keys), batch):
        dep.store(keys[i:i + batch], datas[i:i + batch])
    return time.perf_counter() - t0


def load_all(dep: Deployment, keys, batch: int) -> tuple[float, list[bytes]]:
    t0 = time.perf_counter()
    got: list[bytes] = []
    for i in range(0, len(keys), batch):
        got += dep.load(keys[i:i + batch])
    return time.perf_counter() - t0, got


def throughput(backend: str, root: str, model: str, chunks: int, batch: int, block_bytes: int, rep: int) -> dict:
    path = os.path.join(root, f"{backend}-{rep}")
    dep = Deployment(model, [tier_cfg(backend, path)], cpu_chunks=chunks, block_bytes=block_bytes)
    keys, datas = data(chunks, dep.chunk_bytes, f"tp{rep}".encode())
    ts = store_all(dep, keys, datas, batch)
    dep.close()
    dep = Deployment(model, [tier_cfg(backend, path)], cpu_chunks=2 * batch, block_bytes=block_bytes)
    tl, got = load_all(dep, keys, batch)
    dep.close()
    nbytes = chunks * dep.chunk_bytes
    return {"store_gbps": nbytes / ts / 1e9, "load_gbps": nbytes / tl / 1e9,
            "exact": sum(g == d for g, d in zip(got, datas)), "served": len(got)}


def flipped(backend: str, root: str, model: str, block_bytes: int) -> dict:
    path = os.path.join(root, f"{backend}-flip")
    dep = Deployment(model, [tier_cfg(backend, path)], cpu_chunks=8, block_bytes=block_bytes)
    keys, datas = data(4, dep.chunk_bytes, b"flip")
    dep.store(keys, datas)
    tier = dep.tiers[0]
    if backend == "fs":
        fname, off = tier.file_mapper.get_file_name(keys[0]), 1000
    else:
        from kvtier.tiers.nvme_block import slot_stride
        from kvtier.tiers.nvme_dir import DATA_FILE
        fname = os.path.join(tier.tier.dir, DATA_FILE)
        off = tier.tier.find(keys[0]) * slot_stride(dep.chunk_bytes) + 4096 + 1000
    dep.close()
    with open(fname, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x01]))
    dep = Deployment(model, [tier_cfg(backend, path)], cpu_chunks=8, block_bytes=block_bytes)
    got = dep.load(keys[:1])
    counters = dict(getattr(dep.tiers[0], "counters", {}))
    dep.close()
    if not got:
        return {"result": "miss", "counters": counters}
    return {"result": "served, byte-exact" if got[0] == datas[0] else "served CORRUPT bytes", "counters": counters}


def child(backend: str, path: str, model: str, block_bytes: int, batch: int) -> None:
    """Store batches forever, printing each batch index once its cascade finished."""
    dep = Deployment(model, [tier_cfg(backend, path)], cpu_chunks=4 * batch, block_bytes=block_bytes,
                     engine_id=f"kvtier-bench-kill-{os.getpid()}")
    for b in range(10**6):
        keys, datas = data(batch, dep.chunk_bytes, f"kill{b}".encode())
        dep.store(keys, datas)
        print(b, flush=True)


def killed(backend: str, root: str, model: str, block_bytes: int, batch: int, after: int) -> dict:
    path = os.path.join(root, f"{backend}-kill")
    p = subprocess.Popen([sys.executable, __file__, "--child", backend, path, model, str(block_bytes), str(batch)],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    done = -1
    while done < after:
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"{backend}: the storing process died before {after} batches")
        done = int(line)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    for f in os.listdir("/dev/shm"):
        if f == f"vllm_offload_kvtier-bench-kill-{p.pid}.mmap":
            os.unlink(os.path.join("/dev/shm", f))
    dep = Deployment(model, [tier_cfg(backend, path)], cpu_chunks=2 * batch, block_bytes=block_bytes)
    served = exact = 0
    for b in range(done + 2):      # what it reported, and the batch in flight when killed
        keys, datas = data(batch, dep.chunk_bytes, f"kill{b}".encode())
        got = dep.load(keys)
        served += len(got) if b <= done else 0
        exact += sum(g == d for g, d in zip(got, datas)) if b <= done else 0
        if b > done:
            in_flight = (len(got), sum(g == d for g, d in zip(got, datas)))
    dep.close()
    return {"reported_stored": (done + 1) * batch, "served": served, "byte_exact": exact,
            "in_flight_batch_served_exact": in_flight}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _, _, backend, path, model, bb, batch = sys.argv
        return child(backend, path, model, int(bb), int(batch))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=256)
    ap.add_argument("--chunk-kib", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16, help="chunks per request")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the tiers' files go (default: a temp dir under /var/tmp)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    root = tempfile.mkdtemp(prefix="kvtier-native-", dir=a.dir or "/var/tmp")
    block_bytes = a.chunk_kib * 1024 // BLOCKS_PER_CHUNK
    model = model_dir(root, 0)
    out: dict = {"chunks": a.chunks, "chunk_bytes": a.chunk_kib * 1024, "batch": a.batch, "reps": a.reps}
    try:
        for backend in ("fs", "kvtier"):
            runs = [throughput(backend, root, model, a.chunks, a.batch, block_bytes, r) for r in range(a.reps)]
            out[backend] = {"store_gbps": statistics.median(r["store_gbps"] for r in runs),
                            "load_gbps": statistics.median(r["load_gbps"] for r in runs),
                            "loads_byte_exact": f"{min(r['exact'] for r in runs)}/{a.chunks}",
                            "flipped_byte": flipped(backend, root, model, block_bytes),
                            "kill_9": killed(backend, root, model, block_bytes, a.batch, 8)}
        out["ratio_store"] = out["kvtier"]["store_gbps"] / out["fs"]["store_gbps"]
        out["ratio_load"] = out["kvtier"]["load_gbps"] / out["fs"]["load_gbps"]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if a.json:
        print(json.dumps(out, indent=1, default=str))
        return
    print(f"{a.chunks} chunks x {a.chunk_kib} KiB, requests of {a.batch}, median of {a.reps}")
    for b in ("fs", "kvtier"):
        r = out[b]
        print(f"{b:7s} store {r['store_gbps']:.3f} GB/s  load {r['load_gbps']:.3f} GB/s  exact {r['loads_byte_exact']}"
              f"  flipped byte: {r['flipped_byte']['result']}  kill -9: {r['kill_9']}")
    print(f"kvtier / fs: store {out['ratio_store']:.2f}x, load {out['ratio_load']:.2f}x")


if __name__ == "__main__":
    main()
