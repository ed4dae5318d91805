"""Parallel-agnostic blocks in real vLLM (CPU build): a cache written at one tensor-parallel size
served at another, through NVMe or the shared tier. Run as a script (vLLM spawns its TP workers
from `__main__`); prints one JSON line.

    python tests/topology_e2e.py WORKDIR nvme|shared [REDIS_URL|-] [llama|gemma3]

Engines, one after another on one store: TP=1 writes prompts A; TP=2 reads A (hits) and writes
B; TP=1 reads B. Then a payload byte of part 1 (the second KV head's bytes, which TP=2's rank 1
wrote or reads) is flipped in one block of A and one of B: a TP=2 engine reading A and a TP=1
engine reading B each find it corrupt and recompute it. Tokens are compared with vLLM alone at
the reader's TP size.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vllm_util as U  # noqa: E402

CAP = 64


def main(work: str, medium: str, url: str = "-", kind: str = "llama") -> None:
    cores = sorted(os.sched_getaffinity(0))[:2]
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, cores)))
    build = U.build_tiny_gemma3 if kind == "gemma3" else U.build_tiny_llama   # gemma3: a hybrid model
    model = build(os.path.join(work, "model"))
    A, B = U.prompts(3, 4, seed=11), U.prompts(3, 4, seed=12)
    nvme = os.path.join(work, "nvme")
    lower = (f'  - {{name: nvme, kind: nvme, path: "{nvme}", capacity_blocks: {CAP}}}' if medium == "nvme"
             else f'  - {{name: shared, kind: shared, url: "{url}"}}')
    cfg = os.path.join(work, "kvtier.yaml")
    with open(cfg, "w") as f:
        f.write(f"tiers:\n  - {{name: cpu, kind: cpu, capacity_blocks: {CAP}}}\n{lower}\n")

    def llm(tp: int, kv: bool = True):
        binds = {"VLLM_CPU_OMP_THREADS_BIND": "|".join(map(str, cores[:tp])) if tp > 1 else str(cores[0])}
        os.environ.update(binds)
        return U.make_llm(model, U.kvtier_config(config=cfg) if kv else None, tensor_parallel_size=tp,
                          distributed_executor_backend="mp" if tp > 1 else "uni")

    def conn():
        import kvtier.connector as C
        return [c for c in C.live_connectors("scheduler") if c.sched is not None][-1]

    base = {}
    for tp in (1, 2):
        e = llm(tp, kv=False)
        base[tp] = (U.generate(e, A, 8), U.generate(e, B, 8))
        U.shutdown(e)

    out: dict = {}

    def run(tp: int, name: str, prompts: list, want: list, settle: bool = True) -> None:
        e = llm(tp)
        c = conn()
        t0 = dict(c.sched.totals)
        got = U.generate(e, prompts, 8)
        if settle:
            U.run_steps(e, 6)   # write-behind: every writer's report is in within the lag
        t = dict(c.sched.totals)
        out[name] = {"same_tokens": got == want, "hits": int(t.get(f"hit_tokens.{medium}", 0) - t0.get(f"hit_tokens.{medium}", 0)),
                     "stored": int(t.get(f"stored_blocks.{medium}", 0) - t0.get(f"stored_blocks.{medium}", 0)),
                     "corrupt": int(t.get(f"corrupt_blocks.{medium}", 0) + t.get(f"bad_blocks.{medium}", 0)),
                     "load_failed": int(t.get(f"failed_load_blocks.{medium}", 0)),
                     "hook_errors": int(sum(v for k, v in t.items() if k.startswith("hook_errors"))),
                     "parts": c.parts.describe()}
        if name == "tp1_writes_a":
            out["fingerprint_has_tp"] = "tp" in c.fingerprint
        U.shutdown(e)

    run(1, "tp1_writes_a", A, base[1][0])
    run(2, "tp2_reads_a", A + B, base[2][0] + base[2][1])
    run(1, "tp1_reads_b", B, base[1][1])
    if medium == "nvme":
        out["files"] = sorted(f for f in os.listdir(nvme) if f.startswith("data."))
        flip_nvme(nvme)
    else:
        out["flipped"] = flip_shared(url)
    run(2, "tp2_reads_flipped_a", A[:1], base[2][0][:1], settle=False)
    run(1, "tp1_reads_flipped_b", B[:1], base[1][1][:1], settle=False)
    print(json.dumps(out), flush=True)


def flip_nvme(nvme: str) -> None:
    """Flip one payload byte of part 1 in every slot (data.1): each block A and B stored."""
    with open(os.path.join(nvme, "fingerprint.json")) as f:
        length = json.load(f)["block_bytes"]
    from kvtier.tiers.nvme_block import slot_stride
    stride = slot_stride(length)
    path = os.path.join(nvme, "data.1")
    with open(path, "r+b") as f:
        for slot in range(os.path.getsize(path) // stride):
            f.seek(slot * stride + 4096 + 17)
            b = f.read(1)
            f.seek(slot * stride + 4096 + 17)
            f.write(bytes([b[0] ^ 0xFF]))


def flip_shared(url: str) -> int:
    """Flip one payload byte of every part-1 value on the server."""
    import redis
    c = redis.Redis.from_url(url)
    n = 0
    for k in c.scan_iter(match=b"kvt:*:1:*", count=1000):
        v = c.get(k)
        c.setrange(k, len(v) - 5, bytes([v[-5] ^ 0xFF]))
        n += 1
    c.close()
    return n


if __name__ == "__main__":
    main(*sys.argv[1:5])
