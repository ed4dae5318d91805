"""The vLLM connector: `kv_connector="KVTierConnector"`, `kv_connector_module_path="kvtier.connector"`.

Importing this package imports vLLM; the pure-Python parts (scheduler.py, metadata.py,
config.py) work without it.
"""

from .connector import KVTierConnector, live_connectors

__all__ = ["KVTierConnector", "live_connectors"]
