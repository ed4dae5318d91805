"""The vLLM connector: `kv_connector="KVTierConnector"`, `kv_connector_module_path="kvtier.connector"`.

`KVTierConnector` (and `live_connectors`) import vLLM when first used; the worker-side data path
(worker.py, kv_layout.py, device_copy.py) and the pure-Python parts (scheduler.py, metadata.py,
config.py) import without it (`benchmarks/gpu/check.sh` runs them on a machine with no vLLM).
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVTierConnector", "live_connectors"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import connector
        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
