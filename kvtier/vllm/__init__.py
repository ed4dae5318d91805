"""kvtier's tiers and eviction policies inside vLLM's native offloading (`TieringOffloadingSpec`).

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": ...,
        "secondary_tiers": [{"type": "KvtierNvmeTier", "module_path": "kvtier.vllm", "path": ...},
                            {"type": "KvtierSharedTier", "module_path": "kvtier.vllm", "url": ...}]}}'

Importing this package imports vLLM; nothing in kvtier's core, tiers or policies imports it.
See docs/vllm-native.md.
"""

from .cache_policies import KvtierARC, KvtierCachePolicy, KvtierLRU, KvtierS3FIFO
from .nvme_tier import KvtierNvmeTier
from .shared_tier import KvtierSharedTier

__all__ = ["KvtierARC", "KvtierCachePolicy", "KvtierLRU", "KvtierNvmeTier", "KvtierS3FIFO", "KvtierSharedTier"]
