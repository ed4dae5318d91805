"""The connector's parts, built from vLLM's config and kvtier's settings.

`KVShape`: vLLM's KV cache as kvtier sees it (groups, block bytes and tokens, whether it is
served). `settings`: the YAML sized to it. `fingerprint`: what must match for a stored block to
be served. `scheduler_side`: the persistent tiers, the controller, the group rules, the trace
recorder and the scheduler; `start_scheduler_side`: what the scheduler side does once at start.
`worker_side`: the `KVTierWorker`.
"""

from __future__ import annotations

import logging
import math
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import xxhash

from kvtier.core.builder import build_controller

from .config import load_settings, tier_of
from kvtier.core.digest_cache import data_dir_of
from .drain import drain_at_sigterm
from .groups import Group, GroupKind, block_geometry, served_groups
from .handoff import clear_reports
from .groups import GroupRules
from kvtier.core.identity import ModelIdentity
from .engine_identity import effective_config_digest, load_source, weights_pin
from .kv_layout import layout_name
from .metadata import HOLD_LIMIT_S
from .parallel import (Parts, check_parts, context_parallel, context_parallel_refused, storage_parts,
                       world_size)
from .scheduler import KVTierScheduler, PersistentTiers, SchedulerOptions
from .startup import flush_budget_s, shared_opener, warn_per_process_hashes
from .worker import SHUTDOWN_FLUSH_TIMEOUT_S, KVTierWorker

log = logging.getLogger("kvtier.connector")


@dataclass(frozen=True)
class KVShape:
    groups: list[Group]
    block_bytes: int          # one block id over every layer region (0: no KV cache)
    block_tokens: int         # vLLM's scheduler block
    why: str | None           # why kvtier cannot serve these groups, or None

    @property
    def enabled(self) -> bool:
        return self.block_bytes > 0 and self.why is None

    @property
    def hybrid(self) -> bool:
        """Several groups, a window, a state or a draft's block: not one plain chain."""
        return len(self.groups) > 1 or any(g.kind is not GroupKind.FULL or g.eagle for g in self.groups)


def kv_shape(vllm_config: Any, kv_cache_config: Any) -> KVShape:
    """Under context parallelism (`parallel.context_parallel`) a block spans vLLM's whole block
    (`block_size x dcp` tokens) and must be vLLM's own scheduler block, else nothing is served."""
    dcp, pcp, _ = context_parallel(vllm_config)
    bb, bt = block_geometry(kv_cache_config, dcp)
    groups, why = served_groups(kv_cache_config, _drops_draft_block(vllm_config), (dcp, pcp))
    if why is None and dcp * pcp > 1:
        why = context_parallel_refused(vllm_config) or _not_vllms_block(vllm_config, kv_cache_config, bt)
    shape = KVShape(groups, bb, bt or vllm_config.cache_config.block_size, why)
    if not shape.enabled:
        log.warning("kvtier: connector disabled: %s", why or f"block of {bb} bytes")
    return shape


def _not_vllms_block(vllm_config: Any, kv_cache_config: Any, tokens: int) -> str | None:
    """Why `tokens` is not vLLM's scheduler block (`resolve_kv_cache_block_sizes`), or None."""
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    theirs, _ = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    if theirs == tokens:
        return None
    return f"kvtier's block of {tokens} tokens is not vLLM's scheduler block of {theirs} under context parallelism"


def _drops_draft_block(vllm_config: Any) -> bool:
    """Speculative decoding whose draft's trailing block a hit drops (EAGLE / MTP)."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return False
    drop = getattr(spec, "use_eagle_block_drop", None) or spec.use_eagle   # vLLM 0.32 / earlier name
    return bool(drop())


def settings(extra: dict | None, shape: KVShape, scheduler: bool, worker_pool: int | None) -> Any:
    """The YAML's settings in vLLM's blocks. The scheduler side's sizes: an nvme tier that does not
    fit its disk is refused (ConfigError); a cpu share takes `worker_pool` (this process's worker
    pool size), else is resolved here and follows the workers' reports."""
    cfg = load_settings(dict(extra or {}))
    cfg = cfg.model_copy(update={"block_bytes": shape.block_bytes or 1, "block_tokens": shape.block_tokens})
    if not (scheduler and shape.enabled):
        return cfg
    from kvtier.core.fit import fit_to_machine
    cfg, _ = fit_to_machine(cfg, kinds=("nvme",))
    cpu = tier_of(cfg, "cpu")
    if cpu is not None and cpu.share() is not None:
        if worker_pool is not None:
            tiers = [t.model_copy(update={"capacity": None, "capacity_blocks": worker_pool}) if t is cpu else t
                     for t in cfg.tiers]
            cfg = cfg.model_copy(update={"tiers": tiers})
        else:
            cfg, _ = fit_to_machine(cfg, kinds=("cpu",), check=False)
    return cfg


def model_identity(cfg: Any, vllm_config: Any, start: bool) -> ModelIdentity:
    """The weights' identity: digested on the scheduler side (`start`), from the path pinned for
    this engine (`engine_identity.weights_pin`); the workers take the scheduler's."""
    model, revision, cache_dir, fmt = load_source(vllm_config)
    given = cfg.serving.model_identity
    return ModelIdentity(model, revision, given, data_dir_of(cfg.serving.data_dir), cache_dir, start=start,
                         load_format=fmt, pinned=weights_pin(vllm_config) if start and not given else None,
                         digest=start)


def model_key(identity: str | None, vllm_config: Any) -> str | None:
    """The fingerprint's `model`: the weights' identity and the engine's effective config
    (`engine_identity`), as the scheduler sends it to the workers; None while not known."""
    return None if identity is None else f"{identity};engine={effective_config_digest(vllm_config)}"


def block_parts(cfg: Any, vllm_config: Any, kv_cache_config: Any, shape: KVShape) -> Parts | None:
    """How this engine stores a block in the persistent tiers (`parallel.storage_parts`), None
    when nothing is served."""
    if not shape.enabled or kv_cache_config is None:
        return None
    rank = int(getattr(getattr(vllm_config, "parallel_config", None), "rank", 0) or 0)
    return storage_parts(vllm_config, kv_cache_config, shape.block_bytes, rank,
                         cfg.serving.parallel_agnostic)


def fingerprint(cfg: Any, vllm_config: Any, shape: KVShape, model: str | None, parts: Parts | None = None) -> dict:
    """What must match for a stored block to be served: the model (`model_key`: its weights'
    identity and the engine's effective config), KV dtype, layout (the blocks' byte format,
    `kv_layout.layout_name`, plus a digest of the groups when several), parallelism: for
    parallel-agnostic blocks (`parts`) the parts and their size instead of tp and pp; else tp, pp
    (and dcp, pcp and the interleave under context parallelism, which decide a rank's bytes)."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    layout = layout_name(device_type(vllm_config))
    if shape.hybrid:
        layout += ":groups-" + xxhash.xxh3_64_hexdigest(repr(shape.groups).encode())
    dcp, pcp, interleave = context_parallel(vllm_config)
    cp = {"dcp": dcp, "pcp": pcp, "cp_interleave": interleave} if dcp * pcp > 1 else {}
    where = parts.fingerprint() if parts is not None and parts.agnostic else {
        "tp": int(getattr(pc, "tensor_parallel_size", 1)), "pp": int(getattr(pc, "pipeline_parallel_size", 1)), **cp}
    return cfg.fingerprint(
        model=model_key(model, vllm_config) or "(not known yet)", revision=str(getattr(mc, "revision", None)),
        dtype=str(getattr(mc, "dtype", "?")),
        kv_cache_dtype=str(getattr(vllm_config.cache_config, "cache_dtype", "auto")),
        layout=layout, **where)


def device_type(vllm_config: Any) -> str:
    """vLLM's device type ("cpu" for the CPU backend)."""
    return str(getattr(getattr(vllm_config, "device_config", None), "device_type", "cuda"))


def stores_finish_later(vllm_config: Any) -> bool:
    """A device's stores complete in a later step (`scheduler.StoreHolds`); the CPU backend's in the hook."""
    return device_type(vllm_config) != "cpu"


def lower_loads_async(vllm_config: Any) -> bool:
    """A device's hits that reach a tier below DRAM load asynchronously (`SchedulerOptions.
    async_lower_loads`: their reads never delay the forward's launch); the CPU backend's in the step."""
    return device_type(vllm_config) != "cpu"


def scheduler_side(cfg: Any, vllm_config: Any, kv_cache_config: Any, shape: KVShape, identity: ModelIdentity,
                   fingerprint_of: Callable[[str | None], dict], parts: Parts | None
                   ) -> tuple[Any, Any, KVTierScheduler]:
    """(the persistent tiers or None, the trace recorder or None, the scheduler)."""
    policy = getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy", "recompute")
    if policy != "recompute":
        log.warning("kvtier: kv_load_failure_policy=%r: a block kvtier fails to load (I/O error, "
                    "checksum mismatch) fails its request; set 'recompute' to recompute it", policy)
    persistent = None
    if parts is not None:
        persistent = PersistentTiers(cfg, identity, fingerprint_of, parts.count, part_bytes=parts.part_bytes)
    # every rank reports every store (each copies into its own pool), within the workers' hold bound;
    # a copy down commits once every writer of the block's parts reported
    ctrl = build_controller(cfg, persistent.build() if persistent is not None else [],
                            ranks=parts.writers if parts is not None else 1,
                            reporters=world_size(vllm_config), report_timeout_s=HOLD_LIMIT_S)
    rules = None
    if shape.groups:
        # MTP with several modules re-prefills its last lookahead tokens: not final until then
        reprefill = max(0, int(getattr(vllm_config, "num_prefill_lookahead_tokens", 0) or 0) - 1)
        rules = GroupRules(shape.groups, math.gcd(*[g.block_tokens for g in shape.groups]), reprefill)
    recorder = None
    sv = cfg.serving
    if sv.record_trace and shape.enabled:
        from .recorder import TraceRecorder, served_geometry
        recorder = TraceRecorder(sv.record_trace, shape.block_tokens, sv.record_max_bytes, count=ctrl.count,
                                 geometry=served_geometry(fingerprint_of(identity.value), shape.block_bytes))
    opts = SchedulerOptions(store=sv.store and shape.enabled, offload=cfg.policy.offload,
                            max_blocks_per_step=sv.max_blocks_per_step,
                            async_shared_loads=sv.async_shared_loads and not shape.hybrid,
                            async_lower_loads=lower_loads_async(vllm_config),
                            hold_stores=stores_finish_later(vllm_config))
    return persistent, recorder, KVTierScheduler(ctrl, rules, opts, recorder, model_key(identity.value, vllm_config))


def start_scheduler_side(sched: KVTierScheduler, vllm_config: Any, cfg: Any) -> None:
    """SIGTERM: lazy offload writes behind within vLLM's shutdown timeout; a warning when the
    shared tier meets per-process hashes; the shutdown reports an earlier run left are dropped."""
    drain_at_sigterm(weakref.ref(sched), getattr(vllm_config, "shutdown_timeout", 0),
                     flush_budget_s(SHUTDOWN_FLUSH_TIMEOUT_S))
    if tier_of(cfg, "shared") is not None:
        warn_per_process_hashes(vllm_config)
    for t in sched.nvme_tiers():
        if clear_reports(t.dir):
            log.warning("kvtier: %s: dropped a shutdown report an earlier run left unread", t.dir)


def worker_side(cfg: Any, vllm_config: Any, kv_cache_config: Any, shape: KVShape, fp: dict,
                parts: Parts | None) -> KVTierWorker:
    rank = int(getattr(getattr(vllm_config, "parallel_config", None), "rank", 0) or 0)
    shared = tier_of(cfg, "shared")

    def parts_of(layout: Any) -> tuple[Parts, list]:
        return check_parts(parts, layout, vllm_config, kv_cache_config, rank)
    return KVTierWorker(cfg, rank=rank, ranks=world_size(vllm_config), parts_of=parts_of if parts is not None else None,
                        expected_block_bytes=shape.block_bytes or None,
                        num_blocks=getattr(kv_cache_config, "num_blocks", None),
                        shared_fn=shared_opener(shared, fp) if shared else None, shared_needs_identity=True)
