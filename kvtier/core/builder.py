"""One builder: a YAML stack (`StackConfig`) -> tiers, policies and the `TierController`.

Used by the CLI, replay and the vLLM connector alike. `data` says how much of each persistent
tier is opened: "full" (index and data file: the offline stack), "control" (the index only:
the connector's scheduler, whose workers own the data files) or "none" (metadata only: replay
without bytes).
"""

from __future__ import annotations

from typing import Any, Sequence

from kvtier.policies import ADMISSION, EVICTION, PROMOTION, AdmissionPolicy, EvictionPolicy, PromotionPolicy

from kvtier.core.config import ConfigError, StackConfig, TierConfig
from kvtier.core.controller import TierController

DATA_MODES = ("full", "control", "none")


def policy_params(params: dict[str, Any], name: str) -> dict[str, Any]:
    """The keyword arguments YAML `policy.params` gives policy `name` (none when not a mapping)."""
    p = params.get(name, {})
    return p if isinstance(p, dict) else {}


def _construct(cfg: StackConfig, name: str, cls: Any, *args: Any, **kw: Any) -> Any:
    """cls(*args, **kw); a bad parameter value is a ConfigError naming the policy and its params."""
    try:
        return cls(*args, **kw)
    except (ValueError, TypeError) as e:
        msg = str(e)
        if not msg.startswith(f"{name}:"):
            msg = f"{name}: {msg}"
        raise ConfigError(f"{cfg.source}: policy.params.{name} {policy_params(cfg.policy.params, name)}: {msg}") \
            from None


def make_eviction(cfg: StackConfig, tcfg: TierConfig, capacity: int) -> EvictionPolicy:
    name = tcfg.eviction or cfg.policy.eviction
    return _construct(cfg, name, EVICTION.get(name), capacity, **policy_params(cfg.policy.params, name))


def make_admission(cfg: StackConfig) -> list[AdmissionPolicy]:
    """Per storage tier its admission policy."""
    out = []
    for t in cfg.storage_tiers():
        name = t.admission or cfg.policy.admission
        out.append(_construct(cfg, name, ADMISSION.get(name), **policy_params(cfg.policy.params, name)))
    return out


def make_promotion(cfg: StackConfig) -> PromotionPolicy:
    name = cfg.policy.promotion
    return _construct(cfg, name, PROMOTION.get(name), **policy_params(cfg.policy.params, name))


def build_tier(cfg: StackConfig, index: int, data: str = "full", fingerprint: dict | None = None,
               ranks: int = 1, closed: str | None = None, part_bytes: int | None = None) -> Any:
    """Storage tier `index` of the config (the gpu tier is vLLM's block pool, not built here).
    `ranks`: the parts of every block (the shared tier asks for all of them); `part_bytes`: one
    part's bytes in the persistent tiers (default the block's).
    `closed`: a persistent tier (nvme, redis) is built closed, for this reason (`ClosedTier`)."""
    if data not in DATA_MODES:
        raise ValueError(f"data must be one of {DATA_MODES}, got {data!r}")
    t = cfg.storage_tiers()[index]
    if closed is not None and t.kind in ("nvme", "shared"):
        from kvtier.tiers.closed import ClosedTier
        from kvtier.tiers.contract import Medium
        return ClosedTier(t.name, Medium.SHARED if t.kind == "shared" else Medium.FILE, t.kind == "shared",
                          cfg.block_bytes, closed)
    cap = t.blocks(cfg.block_bytes)
    fp = fingerprint or cfg.fingerprint()
    bb = part_bytes or cfg.block_bytes   # the persistent tiers store parts of this size
    # checked with or without the data (the connector's scheduler): a bad key fails the start, in one line
    sealer = tier_sealer(cfg, t) if data != "none" else None
    if t.kind == "shared":
        if data == "none":
            from kvtier.tiers.shared import SimSharedTier
            return SimSharedTier(t.name, cap, cfg.block_bytes)
        from kvtier.tiers.shared import SharedTier
        from kvtier.tiers.shared_conn import RedisSettings
        return SharedTier(t.name, RedisSettings.of(t), fp, bb, ranks=ranks, capacity_blocks=cap,
                         data=data == "full", threads=t.io_threads, sealer=sealer)
    eviction = make_eviction(cfg, t, cap)
    if t.kind == "cpu":
        from kvtier.tiers.cpu import CpuTier
        return CpuTier(t.name, cap, cfg.block_bytes, eviction, pin=t.pin, with_data=data == "full")
    if t.kind == "nvme":
        if data == "control":
            from kvtier.tiers.nvme_control import NvmeControl
            return NvmeControl(t.name, t.path, cap, bb, eviction, fingerprint=fp,
                               on_mismatch=t.on_fingerprint_mismatch)
        from kvtier.tiers.nvme import NvmeTier
        return NvmeTier(t.name, t.path, cap, bb, eviction, io=t.io, fingerprint=fp,
                        on_mismatch=t.on_fingerprint_mismatch, with_data=data == "full", io_threads=t.io_threads,
                        sealer=sealer)
    raise ValueError(f"tier {t.name!r}: kind {t.kind!r} is not a storage tier")


def tier_sealer(cfg: StackConfig, t: TierConfig | None) -> Any:
    """The `sealing.Sealer` of tier `t`'s `encryption` (None without); a bad key is a ConfigError."""
    from kvtier.tiers.sealing import BadKey, sealer_of
    if t is None:
        return None
    try:
        return sealer_of(t.encryption)
    except BadKey as e:
        raise ConfigError(f"{cfg.source}: tiers[{t.name}].{e}") from None


def build_tiers(cfg: StackConfig, data: str = "full", fingerprint: dict | None = None,
                ranks: int = 1, closed: str | None = None, part_bytes: int | None = None) -> list[Any]:
    tiers: list[Any] = []
    try:
        for i in range(len(cfg.storage_tiers())):
            tiers.append(build_tier(cfg, i, data, fingerprint, ranks, closed, part_bytes))
    except BaseException:
        for t in tiers:
            t.close()
        raise
    return tiers


def build_controller(cfg: StackConfig, tiers: Sequence[Any], ranks: int = 1,
                     lease_timeout_s: float | None = None, reporters: int | None = None,
                     report_timeout_s: float | None = None) -> TierController:
    """The controller over `tiers` with the config's policies (`ranks`, `reporters`,
    `report_timeout_s`: `TierController`'s)."""
    wb = max(1, cfg.writeback_bytes // cfg.block_bytes)
    return TierController(tiers, block_tokens=cfg.block_tokens, admission=make_admission(cfg),
                          promotion=make_promotion(cfg), demotion=cfg.policy.demotion,
                          lease_timeout_s=lease_timeout_s or cfg.serving.lease_timeout_s, ranks=ranks,
                          writeback_blocks=wb, tenants=make_tenants(cfg), reporters=reporters,
                          report_timeout_s=report_timeout_s)


def make_tenants(cfg: StackConfig) -> Any:
    """The config's tenants (quotas split each local tier's eviction policy by tenant), or None."""
    if cfg.tenants is None:
        return None
    from kvtier.core.tenants import Tenants
    tcfg = {t.name: t for t in cfg.storage_tiers()}
    return Tenants(cfg, lambda name, cap: make_eviction(cfg, tcfg[name], cap))


def fresh_evictions(cfg: StackConfig, tiers: Sequence[Any]) -> list[EvictionPolicy]:
    """New eviction policies for `tiers` (a cleared stack starts its policies afresh)."""
    return [make_eviction(cfg, tc, t.capacity_blocks) if tc.kind != "shared" else None
            for tc, t in zip(cfg.storage_tiers(), tiers)]
