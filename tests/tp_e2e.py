"""Tensor parallel 2 inside real vLLM (CPU build, multiprocess executor: one worker process per
rank), run as a script because vLLM spawns its workers from `__main__`.

    python tests/tp_e2e.py WORKDIR [llama|gemma3]   # prints one JSON line

gemma3: a hybrid model (sliding window + full attention, two KV-cache groups, vLLM's hybrid
allocator on), each rank storing every group's shard.

Pass 1 writes through to NVMe (each rank its own data.<rank>); pass 2 is a new LLM on the same
directory (restart): every full block is an NVMe hit, each rank reads its own shard; pass 3 is a
new LLM after a byte flip in rank 1's copy of one block: that block is recomputed. Tokens are
compared with a TP=2 run without the connector.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vllm_util as U  # noqa: E402

TP = 2
CAP = 64


def main(work: str, kind: str = "llama") -> None:
    # one core per rank (vLLM's automatic binding wants a NUMA node per rank)
    cores = sorted(os.sched_getaffinity(0))[:TP]
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, cores)))
    if kind == "gemma3":
        model = U.build_tiny_gemma3(os.path.join(work, "model"))
        prompts = U.prompts(4, 6, seed=3)
    else:
        model = U.build_tiny_llama(os.path.join(work, "model"))
        prompts = U.prompts(4, 4, seed=7)
    nvme = os.path.join(work, "nvme")

    def llm(cfg=None):
        return U.make_llm(model, cfg, tensor_parallel_size=TP, distributed_executor_backend="mp")

    def kv():
        return U.kvtier_config(cpu_capacity_blocks=CAP, nvme_path=nvme, nvme_capacity_blocks=CAP)

    def sched():
        import kvtier.connector as C
        return [c for c in C.live_connectors("scheduler") if c.sched is not None][-1].sched

    out: dict = {}
    e = llm()
    baseline = U.generate(e, prompts, 8)
    U.shutdown(e)

    e = llm(kv())
    first = U.generate(e, prompts, 8)
    U.run_steps(e, 6)  # write-behind: every rank's report is in within the lag
    t = dict(sched().totals)
    out["hma"] = e.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
    import kvtier.connector as C
    out["parts"] = [c for c in C.live_connectors("scheduler") if c.sched is not None][-1].parts.describe()
    out["pass1"] = {"same_tokens": first == baseline, "stored_cpu": t.get("stored_blocks.cpu", 0),
                    "stored_nvme": t.get("stored_blocks.nvme", 0)}
    U.shutdown(e)
    out["files"] = sorted(f for f in os.listdir(nvme) if f.startswith("data."))

    e = llm(kv())
    s = sched()
    out["restored"] = s.tiers[1].restored_blocks
    entry = next(iter(s.tiers[1].index.items()))[1]
    out["rank_sums"] = len(entry.rank_sums)
    t0 = dict(s.totals)
    second = U.generate(e, prompts, 8)
    out["pass2"] = {"same_tokens": second == baseline, "hits": U.tier_hits(t0, dict(s.totals)),
                    "corrupt": s.totals.get("corrupt_blocks.nvme", 0)}
    if kind == "gemma3":   # a full-attention block: every hit loads it (a window block may not)
        slot = next(e.slot for k, e in s.tiers[1].index.items() if not k.endswith(b"\0\0\0\0"))
    else:
        slot = sorted(sl for _, sl in s.tiers[1]._slot_of.items())[3]
    stride = s.tiers[1].stride
    U.shutdown(e)

    with open(os.path.join(nvme, "data.1"), "r+b") as f:  # flip rank 1's shard of one block
        f.seek(slot * stride + 64)
        b = f.read(4)
        f.seek(slot * stride + 64)
        f.write(bytes(x ^ 0xFF for x in b))
    e = llm(kv())
    s = sched()
    t0 = dict(s.totals)
    third = U.generate(e, prompts, 8)
    out["pass3"] = {"same_tokens": third == baseline, "hits": U.tier_hits(t0, dict(s.totals)),
                    "corrupt": s.totals.get("corrupt_blocks.nvme", 0)}
    U.shutdown(e)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], *sys.argv[2:3])
