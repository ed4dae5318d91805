"""kvtier: KV-cache tiering (GPU HBM -> CPU DRAM -> NVMe) for LLM serving."""

__version__ = "0.1.0"

FORMAT_VERSION = 2  # 2: NVMe slots carry a keyed block header (kvtier.tiers.nvme_block)
