"""The connector's configuration: the same YAML schema as the CLI (`kvtier.core.config.StackConfig`).

vLLM's `kv_connector_extra_config` is `{"config": "<YAML path or shipped name>", ...overrides}`.
Each override is a flat key for one field of that schema (table below); the result is
validated by the same schema, so an unknown key or a bad value is one error naming it.
Without "config" the stack is one DRAM tier of 256 blocks.
"""

from __future__ import annotations

from typing import Any

from kvtier.core.config import ConfigError, StackConfig, load_config, parse_config

DEFAULT_CPU_BLOCKS = 256
DEFAULT_NVME_BLOCKS = 1024

# flat override -> (tier kind or None for the top level, field path)
_OVERRIDES: dict[str, tuple[str | None, str]] = {
    "cpu_capacity_blocks": ("cpu", "capacity_blocks"), "cpu_capacity": ("cpu", "capacity"),
    "pin": ("cpu", "pin"), "admission": (None, "policy.admission"),
    "nvme_path": ("nvme", "path"), "nvme_capacity_blocks": ("nvme", "capacity_blocks"),
    "nvme_capacity": ("nvme", "capacity"), "nvme_io": ("nvme", "io"), "nvme_io_threads": ("nvme", "io_threads"),
    "nvme_direct": ("nvme", "direct"), "nvme_on_mismatch": ("nvme", "on_fingerprint_mismatch"),
    "nvme_admission": ("nvme", "admission"), "nvme_eviction": ("nvme", "eviction"),
    "eviction": (None, "policy.eviction"), "promotion": (None, "policy.promotion"),
    "demotion": (None, "policy.demotion"), "offload": (None, "policy.offload"),
    "store": (None, "serving.store"), "lease_timeout_s": (None, "serving.lease_timeout_s"),
    "max_blocks_per_step": (None, "serving.max_blocks_per_step"),
    "nvme_write_lag_steps": (None, "serving.nvme_write_lag_steps"),
    "shared_url": ("shared", "url"), "shared_cluster": ("shared", "cluster"),
    "shared_admission": ("shared", "admission"), "shared_timeout_s": ("shared", "timeout_s"), "async_shared_loads": (None, "serving.async_shared_loads"),
    "record_trace": (None, "serving.record_trace"), "record_max_bytes": (None, "serving.record_max_bytes"),
    "model_identity": (None, "serving.model_identity"), "data_dir": (None, "serving.data_dir"),
    "parallel_agnostic": (None, "serving.parallel_agnostic"),
}
_OLD_NAMES = {f"redis_{k}": f"shared_{k}" for k in ("url", "cluster", "admission", "timeout_s")}  # still read
_KNOWN = {"config", "promote"} | set(_OVERRIDES) | set(_OLD_NAMES)


def load_settings(extra: dict[str, Any] | None) -> StackConfig:
    """kv_connector_extra_config -> a validated StackConfig (block sizes are set later from vLLM)."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - _KNOWN)
    if unknown:
        raise ConfigError(f"kv_connector_extra_config: {', '.join(unknown)}: unknown key(s); "
                          f"known: {', '.join(sorted(_KNOWN))}")
    if extra.get("config"):
        base = load_config(extra["config"], check_env=False)
        source = base.source
        data = base.model_dump(exclude={"source"})
        for t in data["tiers"]:  # keep capacity_blocks or capacity, not both (the dump has both keys)
            if t.get("capacity_blocks") is not None:
                t["capacity"] = None
    else:
        source = "<connector defaults>"
        data = {"tiers": [{"name": "cpu", "kind": "cpu", "capacity_blocks": DEFAULT_CPU_BLOCKS}]}
    if "promote" in extra:  # the old boolean: inclusive promotion or none
        if not isinstance(extra["promote"], bool):
            raise ConfigError(f"kv_connector_extra_config: promote: expected true or false, got {extra['promote']!r}")
        extra.setdefault("promotion", "inclusive" if extra["promote"] else "none")
    for key, value in extra.items():
        if key in ("config", "promote"):
            continue
        kind, path = _OVERRIDES[_OLD_NAMES.get(key, key)]
        if key == "store" and isinstance(value, str):  # "eager" / "off" (older spelling)
            value = value != "off"
        target = data if kind is None else _tier(data, kind)
        *parents, leaf = path.split(".")
        for p in parents:
            target = target.setdefault(p, {})
        target[leaf] = value
        if leaf in ("capacity", "capacity_blocks"):
            target["capacity_blocks" if leaf == "capacity" else "capacity"] = None
    if extra and extra.keys() != {"config"}:
        source += " + kv_connector_extra_config"
    cfg = parse_config(data, source, check_env=False)
    kinds = [t.kind for t in cfg.storage_tiers()]
    if kinds[:1] != ["cpu"] or any(kinds.count(k) > 1 for k in ("cpu", "nvme")):
        raise ConfigError(f"{source}: tiers: the vLLM connector runs one cpu tier, optionally one nvme "
                          f"tier and one shared tier below it (its workers copy GPU blocks through the cpu "
                          f"tier); got "
                          f"{', '.join(kinds) or 'no storage tier'}")
    return cfg


def _tier(data: dict, kind: str) -> dict:
    """The config's first tier of `kind`, added (with a default capacity) when missing."""
    for t in data["tiers"]:
        if t["kind"] == kind:
            return t
    t = {"name": "shared", "kind": kind} if kind == "shared" else {
        "name": kind, "kind": kind, "capacity_blocks": DEFAULT_NVME_BLOCKS if kind == "nvme" else DEFAULT_CPU_BLOCKS}
    data["tiers"].append(t)
    return t


def tier_of(cfg: StackConfig, kind: str):
    return next((t for t in cfg.storage_tiers() if t.kind == kind), None)
