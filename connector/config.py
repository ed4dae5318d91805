"""Connector settings from vLLM's kv_connector_extra_config.

`{"config": "<kvtier YAML path or shipped name>", ...inline overrides}`. The YAML goes through
`kvtier.config.load_config`; inline keys override it. All parsing lives in `load_settings`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DEFAULT_CPU_BLOCKS = 256

_INLINE = {"cpu_capacity_blocks", "cpu_capacity", "eviction", "nvme_path", "nvme_capacity_blocks",
           "nvme_capacity", "store", "lease_timeout_s", "min_store_blocks", "pin", "config", "offload",
           "max_blocks_per_step", "nvme_io", "nvme_io_threads", "nvme_direct", "nvme_on_mismatch", "promote",
           "nvme_write_lag_steps", "admission", "nvme_admission"}
DEFAULT_NVME_BLOCKS = 1024


@dataclass
class Settings:
    cpu_capacity_blocks: int | None = None
    cpu_capacity_bytes: int | None = None
    eviction: str = "lru"
    nvme_eviction: str | None = None  # None: the same as `eviction`
    admission: str = "all"            # is a block worth a CPU slot (registry name)
    nvme_admission: str | None = None  # ... an NVMe slot; None: the same as `admission`
    policy_params: dict[str, Any] = field(default_factory=dict)  # YAML policy.params
    pin: str | bool = "auto"
    nvme_path: str | None = None
    nvme_capacity_blocks: int | None = None
    nvme_capacity_bytes: int | None = None
    store: str = "eager"           # "eager": store blocks (as `offload` says); "off": load only
    offload: str = "eager"         # "eager": as computed; "lazy": from the GPU free queue before reuse
    max_blocks_per_step: int = 64  # lazy offload bound per scheduler step (<= 0: unbounded)
    promote: bool = True           # NVMe hits are read through CPU slots and stay there
    nvme_io: str = "auto"
    nvme_io_threads: int = 4
    nvme_direct: bool | str = "auto"
    nvme_on_mismatch: str = "refuse"
    nvme_write_lag_steps: int = 4  # write-behind: NVMe writes reported within N steps (0: in the step)
    lease_timeout_s: float = 300.0
    source: str = "<defaults>"
    extra: dict[str, Any] = field(default_factory=dict)

    def cpu_blocks(self, block_bytes: int) -> int:
        if self.cpu_capacity_blocks is not None:
            return int(self.cpu_capacity_blocks)
        if self.cpu_capacity_bytes is not None:
            return max(1, int(self.cpu_capacity_bytes) // block_bytes)
        return DEFAULT_CPU_BLOCKS

    def nvme_blocks(self, block_bytes: int) -> int:
        if self.nvme_capacity_blocks is not None:
            return int(self.nvme_capacity_blocks)
        if self.nvme_capacity_bytes is not None:
            return max(1, int(self.nvme_capacity_bytes) // block_bytes)
        return DEFAULT_NVME_BLOCKS


def _size(v: Any) -> int:
    if isinstance(v, (int, float)):
        return int(v)
    try:
        from kvtier.units import parse_size
        return parse_size(v)
    except Exception:
        return int(v)


def load_settings(extra: dict[str, Any] | None) -> Settings:
    extra = dict(extra or {})
    unknown = sorted(set(extra) - _INLINE)
    if unknown:
        raise ValueError(f"kvtier connector: unknown kv_connector_extra_config key(s) {unknown}; "
                         f"known: {sorted(_INLINE)}")
    s = Settings(extra=extra)
    path = extra.get("config")
    if path:
        from kvtier.config import load_config  # the lead's YAML loader
        cfg = load_config(path)
        s.source = str(getattr(cfg, "source", path))
        s.eviction = cfg.policy.eviction
        s.admission = cfg.policy.admission
        s.policy_params = dict(cfg.policy.params)
        s.offload = cfg.policy.offload
        off = cfg.policy.params.get(cfg.policy.offload)
        mbs = (off or {}).get("max_blocks_per_step") if isinstance(off, dict) else None
        mbs = cfg.policy.params.get("max_blocks_per_step", mbs)
        if mbs is not None:
            s.max_blocks_per_step = int(mbs)
        s.promote = cfg.policy.promotion == "inclusive"
        for t in cfg.storage_tiers():
            if t.kind == "cpu":
                s.cpu_capacity_blocks = t.capacity_blocks
                s.cpu_capacity_bytes = t.capacity
                s.pin = t.pin
                if t.eviction:
                    s.eviction = t.eviction
                if t.admission:
                    s.admission = t.admission
            elif t.kind == "nvme":
                s.nvme_path = t.path
                s.nvme_capacity_blocks = t.capacity_blocks
                s.nvme_capacity_bytes = t.capacity
                s.nvme_io = t.io
                s.nvme_io_threads = t.io_threads
                s.nvme_on_mismatch = t.on_fingerprint_mismatch
                if t.eviction:
                    s.nvme_eviction = t.eviction
                if t.admission:
                    s.nvme_admission = t.admission
    if "cpu_capacity_blocks" in extra:
        s.cpu_capacity_blocks = int(extra["cpu_capacity_blocks"])
        s.cpu_capacity_bytes = None
    if "cpu_capacity" in extra:
        s.cpu_capacity_bytes = _size(extra["cpu_capacity"])
        s.cpu_capacity_blocks = None
    if "eviction" in extra:
        s.eviction = str(extra["eviction"])
    for k in ("admission", "nvme_admission"):
        if k in extra:
            setattr(s, k, str(extra[k]))
    if "pin" in extra:
        s.pin = extra["pin"]
    if "nvme_path" in extra:
        s.nvme_path = extra["nvme_path"]
    if "nvme_capacity_blocks" in extra:
        s.nvme_capacity_blocks = int(extra["nvme_capacity_blocks"])
    if "nvme_capacity" in extra:
        s.nvme_capacity_bytes = _size(extra["nvme_capacity"])
    if "store" in extra:
        s.store = str(extra["store"])
        if s.store not in ("eager", "off"):
            raise ValueError(f"kvtier connector: store must be 'eager' or 'off', got {s.store!r}")
    if "offload" in extra:
        s.offload = str(extra["offload"])
    if s.offload not in ("eager", "lazy"):
        raise ValueError(f"kvtier connector: offload must be 'eager' or 'lazy', got {s.offload!r}")
    if "max_blocks_per_step" in extra:
        s.max_blocks_per_step = int(extra["max_blocks_per_step"])
    if "promote" in extra:
        s.promote = bool(extra["promote"])
    for k in ("nvme_io", "nvme_on_mismatch"):
        if k in extra:
            setattr(s, k, str(extra[k]))
    if "nvme_io_threads" in extra:
        s.nvme_io_threads = int(extra["nvme_io_threads"])
    if "nvme_write_lag_steps" in extra:
        s.nvme_write_lag_steps = int(extra["nvme_write_lag_steps"])
        if s.nvme_write_lag_steps < 0:
            raise ValueError(f"kvtier connector: nvme_write_lag_steps must be >= 0, got {s.nvme_write_lag_steps}")
    if "nvme_direct" in extra:
        s.nvme_direct = extra["nvme_direct"]
    if "lease_timeout_s" in extra:
        s.lease_timeout_s = float(extra["lease_timeout_s"])
    return s
