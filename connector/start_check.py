"""A bad config stops vLLM's start with one line, as early as vLLM calls into the connector.

vLLM 0.32 builds the connector's objects after the model is loaded. Two class methods run
earlier, and both read the config here (`load_settings`, the checks `__init__` runs again):

- `requires_piecewise_for_cudagraph`, while vLLM builds its config, before the engine starts and
  the model loads. vLLM calls it only with full CUDA graphs (a GPU, no `--enforce-eager`).
- `get_required_kvcache_layout`, in the engine core once the model is loaded, before the KV cache
  is profiled and allocated and before any connector object is built (always, unless
  `VLLM_KV_CACHE_LAYOUT` or a layout in vLLM's cache config makes vLLM skip the question).

A config that fails there raises `StartRefused`, a `SystemExit` whose code is the line
`kvtier: error: <file>: <field>: <cause>`: Python prints it as the process ends, without a
traceback, so it is the last line that process writes.
"""

from __future__ import annotations

from typing import Any

from .config import load_settings

INVALID = ": invalid configuration"


class StartRefused(SystemExit):
    """vLLM's start refused for a bad kvtier config; `code` is the one line printed at exit."""


def error_line(err: BaseException) -> str:
    """A config error as `kvtier: error: <file>: <field>: <cause>` (several causes joined by '; ')."""
    first, *rest = [ln.strip() for ln in str(err).splitlines() if ln.strip()] or ["(no message)"]
    if first.endswith(INVALID) and rest:
        first = f"{first[:-len(INVALID)]}: {'; '.join(rest)}"
    elif rest:
        first = " ".join([first, *rest])
    return "kvtier: error: " + first.removeprefix("kvtier: ")


def check_config(extra: dict[str, Any] | None) -> None:
    """Raise StartRefused when `kv_connector_extra_config` (and the YAML it names) is not a valid config."""
    try:
        load_settings(extra)
    except ValueError as e:   # ConfigError, an unknown key
        raise StartRefused(error_line(e)) from None


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
        """No layout of its own (kvtier copies any of vLLM's); the config is checked here."""
        check_config(getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None))
        return None
