"""kvtier: KV-cache tiering (GPU HBM -> CPU DRAM -> NVMe) for LLM serving."""

__version__ = "0.1.0"

FORMAT_VERSION = 1
