"""A bad config stops vLLM's start with one line, as early as vLLM calls into the connector.

vLLM 0.32 builds the connector's objects after the model is loaded. Two class methods run
earlier, and both read the config here (`load_settings`, the checks `__init__` runs again):

- `requires_piecewise_for_cudagraph`, while vLLM builds its config, before the engine starts and
  the model loads. vLLM calls it only with full CUDA graphs (a GPU, no `--enforce-eager`).
- `get_required_kvcache_layout`, in the engine core once the model is loaded, before the KV cache
  is profiled and allocated and before any connector object is built (always, unless
  `VLLM_KV_CACHE_LAYOUT` or a layout in vLLM's cache config makes vLLM skip the question).

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
import stat
import sys
import time
from typing import Any

from kvtier.core.serving_stats import run_dir

from .config import load_settings
from .engine_identity import weights_pin

INVALID = ": invalid configuration"
PREFIX = "kvtier: error: "
LOADED_AT = time.time()


class StartRefused(SystemExit):
    """vLLM's start refused for a bad kvtier config; `code` is the one line printed at exit."""


def error_line(err: BaseException) -> str:
    """A config error as `kvtier: error: <file>: <field>: <cause>` (several causes joined by '; ')."""
    first, *rest = [ln.strip() for ln in str(err).splitlines() if ln.strip()] or ["(no message)"]
    if first.endswith(INVALID) and rest:
        first = f"{first[:-len(INVALID)]}: {'; '.join(rest)}"
    elif rest:
        first = " ".join([first, *rest])
    return PREFIX + first.removeprefix("kvtier: ")


def check_config(extra: dict[str, Any] | None) -> None:
    """Raise StartRefused when `kv_connector_extra_config` (and the YAML it names) is not a valid config."""
    try:
        load_settings(extra)
    except ValueError as e:   # ConfigError, an unknown key
        line = error_line(e)
        if multiprocessing.parent_process() is not None:
            leave_for_parent(line)
        raise StartRefused(line) from None


def handoff_path(pid: int) -> str:
    return os.path.join(run_dir(), f"start-refused.{pid}")


def leave_for_parent(line: str) -> None:
    """The line, for the parent process to print as it exits (best effort: the line is printed here anyway)."""
    try:
        os.makedirs(run_dir(), 0o700, exist_ok=True)
        st = os.lstat(run_dir())
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():   # not this user's directory
            return
        fd = os.open(handoff_path(os.getppid()), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(line + "\n")
    except OSError:
        pass


@atexit.register
def repeat_a_childs_refusal() -> None:
    """At the exit of a process that ends on an error: the line a child refused its start with, if
    one left it since this module was loaded here, printed last (and removed at any exit)."""
    path = handoff_path(os.getpid())
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd) as f:
            st, line = os.fstat(f.fileno()), f.read(4096).strip()
        os.unlink(path)
    except (OSError, ValueError):   # none left, or not text
        return
    failed = getattr(sys, "last_value", None) is not None   # set only for an uncaught exception
    if failed and st.st_uid == os.getuid() and st.st_mtime >= LOADED_AT - 1 and line.startswith(PREFIX) \
            and "\n" not in line:
        print(line, file=sys.stderr, flush=True)


class StartChecks:
    """The connector's class methods vLLM calls before the connector is built."""

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """True: loads are layer by layer (`wait_for_layer_load`), which a full CUDA-graph replay
        would skip; vLLM then captures piecewise graphs, and attention runs between the pieces."""
        check_config(extra_config)
        return True

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """No layout of its own (kvtier copies any of vLLM's); the config is checked here, and
        the model path is pinned for this engine (`engine_identity.weights_pin`)."""
        check_config(getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None))
        if getattr(vllm_config, "model_config", None) is not None:
            weights_pin(vllm_config)
        return None
