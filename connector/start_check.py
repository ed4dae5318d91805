"""A bad config stops vLLM's start with one line, as early as vLLM calls into the connector.

vLLM 0.32 builds the connector's objects after the model is loaded. Two class methods of
`KVTierConnector` run earlier, forwarded to the functions of the same job here, and both read the
config (`load_settings`, the checks `__init__` runs again):

- `requires_piecewise_for_cudagraph`, while vLLM builds its config, before the engine starts and
  the model loads. vLLM calls it only with full CUDA graphs (a GPU, no `--enforce-eager`).
- `get_required_kvcache_layout`, in the engine core once the model is loaded, before the KV cache
  is profiled and allocated and before any connector object is built (always, unless
  `VLLM_KV_CACHE_LAYOUT` or a layout in vLLM's cache config makes vLLM skip the question).

Both read the encrypted tiers' keys too (`tiers/sealing.py`): a key that cannot be read or is
not a 256-bit key refuses the start like a bad field.

No connector hook of vLLM 0.32 runs in the engine core before the weights load, so the model
path is pinned at the first of these calls there (`engine_identity.weights_pin`) and a symlink on
it changed after the process started counts as changed during the start (kvtier/core/identity.py).

A config that fails there raises `StartRefused`, a `SystemExit` whose code is the line
`kvtier: error: <file>: <field>: <cause>`: Python prints it as the process ends, without a
traceback. An engine core refused so also leaves the line for its parent (vLLM's API server,
which then fails with a traceback of its own), and the parent prints it again as it exits: the
line ends the server's output.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import sys
import time
from typing import Any

from kvtier.core.serving_stats import open_run_dir, run_dir
from kvtier.tiers.redact import redact

from .config import load_settings
from .engine_identity import weights_pin

INVALID = ": invalid configuration"
PREFIX = "kvtier: error: "
LOADED_AT = time.time()


class StartRefused(SystemExit):
    """vLLM's start refused for a bad kvtier config; `code` is the one line printed at exit."""


def error_line(err: BaseException) -> str:
    """A config error as `kvtier: error: <file>: <field>: <cause>` (several causes joined by '; '),
    never a password (`redact`)."""
    first, *rest = [ln.strip() for ln in str(err).splitlines() if ln.strip()] or ["(no message)"]
    if first.endswith(INVALID) and rest:
        first = f"{first[:-len(INVALID)]}: {'; '.join(rest)}"
    elif rest:
        first = " ".join([first, *rest])
    return PREFIX + redact(first.removeprefix("kvtier: "))


def check_config(extra: dict[str, Any] | None) -> None:
    """Raise StartRefused when `kv_connector_extra_config` (and the YAML it names) is not a valid
    config, or an encrypted tier's key cannot be read or is not a 256-bit key."""
    from kvtier.core.builder import tier_sealer
    try:
        cfg = load_settings(extra)
        for t in cfg.storage_tiers():
            tier_sealer(cfg, t)
    except ValueError as e:   # ConfigError, an unknown key
        line = error_line(e)
        if multiprocessing.parent_process() is not None:
            leave_for_parent(line)
        raise StartRefused(line) from None


def handoff_name(pid: int) -> str:
    return f"start-refused.{pid}"


def handoff_path(pid: int) -> str:
    return os.path.join(run_dir(), handoff_name(pid))


def leave_for_parent(line: str) -> None:
    """The line, for the parent process to print as it exits (best effort: the line is printed here
    anyway; a run directory kvtier may not use, or anything planted in it, never blocks this)."""
    try:
        with open_run_dir() as d:
            d.write(handoff_name(os.getppid()), (line + "\n").encode())
    except OSError:
        pass


@atexit.register
def repeat_a_childs_refusal() -> None:
    """At the exit of a process that ends on an error: the line a child refused its start with, if
    one left it since this module was loaded here, printed last (and removed at any exit)."""
    name = handoff_name(os.getpid())
    try:
        with open_run_dir(create=False) as d:
            try:
                st = d.lstat(name)
                line = (d.read(name, 4096) or b"").decode().strip()
            finally:
                d.unlink(name)
    except (OSError, ValueError):   # none left, not text, not a regular file of this user, no run dir
        return
    failed = getattr(sys, "last_value", None) is not None   # set only for an uncaught exception
    if failed and st.st_mtime >= LOADED_AT - 1 and line.startswith(PREFIX) and "\n" not in line:
        print(line, file=sys.stderr, flush=True)


def requires_piecewise_for_cudagraph(extra_config: dict[str, Any]) -> bool:
    """True: loads are layer by layer (`wait_for_layer_load`), which a full CUDA-graph replay
    would skip; vLLM then captures piecewise graphs, and attention runs between the pieces."""
    check_config(extra_config)
    return True


def required_kvcache_layout(vllm_config: Any) -> str | None:
    """No layout of its own (kvtier copies any of vLLM's); the config is checked here, and
    the model path is pinned for this engine (`engine_identity.weights_pin`)."""
    check_config(getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None))
    if getattr(vllm_config, "model_config", None) is not None:
        weights_pin(vllm_config)
    return None


def supports_sleep_mode() -> bool:
    """vLLM 0.33's sleep mode: no. Wake-up remaps the KV cache the workers hold views into
    (connector/kv_layout.py); vLLM refuses `enable_sleep_mode` with kvtier mounted, not stale KV."""
    return False
