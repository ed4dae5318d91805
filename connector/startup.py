"""What the connector says when it starts: one INFO line per side, a WARNING per fallback.

vLLM configures its own `vllm` logger (a handler, propagate off) and leaves the root logger
bare, so records of the `kvtier` logger would only reach Python's last-resort handler (WARNING
and up, no format). `attach_vllm_log_handler` gives `kvtier` vLLM's handlers and level, so
kvtier's lines look like vLLM's and obey `VLLM_LOGGING_LEVEL`; with `VLLM_CONFIGURE_LOGGING=0`
or an application that configured logging itself, it does nothing.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from kvtier.common.counters import Metric

from .config import tier_of

log = logging.getLogger("kvtier.connector")


def attach_vllm_log_handler() -> bool:
    """Route the `kvtier` logger through vLLM's handlers when nothing else would show its INFO."""
    kv = logging.getLogger("kvtier")
    if kv.handlers or logging.getLogger().handlers:
        return False
    vl = logging.getLogger("vllm")
    if not vl.handlers:
        return False
    for h in vl.handlers:
        kv.addHandler(h)
    kv.setLevel(vl.level or logging.INFO)
    kv.propagate = False
    return True


def fit_pool_slots(tier: Any, block_bytes: int, ranks: int = 1,
                   available: int | None = None) -> tuple[int, str | None]:
    """The worker's CPU pool: the tier's capacity in what is available now (vLLM's KV cache is
    already allocated when the worker sizes its pool, so it is counted), shared by the `ranks`
    workers of this host, less `memory_headroom()` (max(10%, 2 GiB) of the host's memory).
    A share ('50%') takes that share of it ("whatever fits"); a size that does not fit is
    refused, as the CLI refuses it: ConfigError, one line naming the key, the size asked and what
    is available. Returns (slots, None)."""
    from kvtier.core.config import ConfigError
    from kvtier.core.fit import available_memory, memory_headroom

    avail = available_memory() if available is None else available
    keep = memory_headroom()
    budget = max(0, avail - keep) // max(1, ranks)
    share = tier.share()
    slots = int(budget * share) // block_bytes if share is not None else tier.blocks(block_bytes)
    if slots >= 1 and budget // block_bytes >= slots:
        return slots, None
    asked = tier.capacity if share is not None else _size(slots * block_bytes)
    where = (f"{_size(budget)} available to {'each of ' + str(ranks) + ' workers' if ranks > 1 else 'it'} "
             f"(MemAvailable {_size(avail)} after vLLM's KV cache, less {_size(keep)} kept free)")
    key = "cpu_capacity" if tier.capacity is not None else "cpu_capacity_blocks"
    raise ConfigError(f"kvtier: tiers.{tier.name}.capacity ({key}): {asked} of DRAM asked, only {where}"
                      + (f": holds no block of {_size(block_bytes)}" if slots < 1 else "")
                      + "; refused: lower it or give a share such as '50%'")


def _size(n: float) -> str:
    for unit, f in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= f:
            return f"{n / f:.1f} {unit}"
    return f"{int(n)} B"


def scheduler_line(conn: Any) -> str:
    """Tiers with capacities, NVMe directory and blocks restored, policies, fingerprint."""
    from kvtier.tiers.nvme_control import fingerprint_hash

    st = conn.config
    nv = tier_of(st, "nvme")
    bb = conn.block_bytes_estimate
    parts = [t.summary() for t in conn.sched.tiers] if conn.sched is not None else []
    fp = conn.fingerprint
    pol = st.policy
    policies = f"eviction {pol.eviction}" + (f"/{nv.eviction}" if nv and nv.eviction else "")
    policies += f", admission {pol.admission}" + (f"/{nv.admission}" if nv and nv.admission else "")
    return (f"kvtier connector (scheduler) started: tiers {'; '.join(parts) or 'none (disabled)'}; "
            f"block {conn.block_tokens} tokens x {_size(bb)}; {policies}, offload {pol.offload}, "
            f"promotion {pol.promotion}, demotion {pol.demotion}, store {st.serving.store}; "
            f"{_identity_part(conn, fingerprint_hash(fp))} ({fp['dtype']}, {_parallel(conn, fp)}); "
            f"config {st.source}")


def _parallel(conn: Any, fp: dict) -> str:
    """The parallel layout as the fingerprint names it, and whether blocks are bound to it."""
    parts = conn.parts.describe() if conn.parts is not None else "not stored"
    if "tp" not in fp:
        return parts
    return f"tp {fp['tp']} pp {fp['pp']}{_cp(fp)}; {parts}"


def _cp(fp: dict) -> str:
    """Context parallelism as the fingerprint names it, or nothing without it."""
    return f" dcp {fp['dcp']} pcp {fp['pcp']} interleave {fp['cp_interleave']}" if "dcp" in fp else ""


def _identity_part(conn: Any, fp_hash: str) -> str:
    """The model's identity and the fingerprint, or why the persistent tiers wait."""
    ident = conn.identity
    if ident.value is not None:
        return f"fingerprint {fp_hash} (model {ident.value}: {ident.how})"
    closed = [conn.sched.tiers[i].name for i in conn.persistent.closed] if conn.persistent is not None else []
    wait = f"; {', '.join(closed)} closed until it is done (the DRAM tier serves)" if closed else ""
    return f"model identity: {ident.how}{wait}"


def worker_line(conn: Any) -> tuple[str, list[str]]:
    """(INFO line, fallback WARNINGs) once the worker has its KV caches and CPU pool."""
    st, w = conn.config, conn.worker
    cpu, nv = tier_of(st, "cpu"), tier_of(st, "nvme")
    warnings: list[str] = []
    lay = w.layout
    pools = w.pools
    pool = pools[0] if pools else None
    gpu = lay is not None and lay.device.type == "cuda"
    line = f"kvtier connector (worker rank {w.rank}) started: "
    if lay is not None:
        line += (f"KV {len(lay.tensors)} layers x {lay.num_blocks} blocks of {_size(lay.block_bytes)} on "
                 f"{lay.device}; ")
    if pool is not None:
        line += (f"cpu pool {pool.num_slots} slots ({_size(pool.num_slots * pool.block_bytes)}, "
                 f"{'pinned' if pool.pinned else 'pageable'}); ")
        # pin=true without CUDA: cpu_pool warns
        if gpu and not pool.pinned and cpu is not None and cpu.pin in ("auto", True):
            warnings.append("kvtier: pinned host memory unavailable; the CPU tier uses pageable memory "
                            "(slower GPU<->CPU copies)")
    if nv is not None:
        line += f"nvme {nv.path}, io {_io_choice(nv, gpu, warnings)}"
    else:
        line += "no nvme tier"
    if w.parts is not None and (nv is not None or w.shared is not None):
        line += f"; {w.parts.describe()}"
    if w.shared is not None:
        line += f"; shared tier {w.shared.description}"
    return line, warnings


def _io_choice(nv: Any, gpu: bool, warnings: list[str]) -> str:
    """The NVMe engine `select_engine` will pick when the worker opens the data file (`nv`: the
    NVMe tier's config). 'auto' is POSIX (the worker's NVMe I/O moves host buffers); 'kvikio' names
    kvikio's mode (GDS or compatibility)."""
    from kvtier.tiers.io_engines import AUTO_HOST_REASON, KVIKIO_HOST_NOTE, cuda_driver_reason
    from kvtier.tiers.io_kvikio import kvikio_mode

    posix = f"posix ({nv.io_threads} threads, O_DIRECT {nv.direct}"
    if nv.io == "posix":
        return posix + ")"
    if nv.io == "auto":
        return f"{posix}; {AUTO_HOST_REASON})"
    why = cuda_driver_reason()
    if why is None:
        try:
            import kvikio  # noqa: PLC0415
            return f"kvikio ({nv.io_threads} threads; mode {kvikio_mode(kvikio)}; {KVIKIO_HOST_NOTE})"
        except Exception as e:
            why = f"kvikio not importable ({type(e).__name__})"
    warnings.append(f"kvtier: nvme io 'kvikio' asked but unusable ({why}): NVMe I/O will fail")
    return f"kvikio (unusable: {why})"


def shared_opener(t: Any, fingerprint: dict):
    """The worker's shared-tier data plane of one part (`part` of the `of` it holds: its keys),
    opened once the block size and the model's identity (`model`, from the scheduler's metadata)
    are known."""
    def open_(block_bytes: int, count, model: str | None, part: int, of: int = 1):
        from kvtier.tiers.shared_conn import Namespace, RedisSettings
        from kvtier.tiers.shared_data import SharedData
        from kvtier.tiers.sealing import sealer_of
        s = RedisSettings.of(t)
        fp = dict(fingerprint, model=model) if model else fingerprint
        return SharedData(s, Namespace(fp, s.secret, part, sealer_of(t.encryption)), block_bytes,
                          threads=max(1, t.io_threads // of), count=count, name=t.name)
    return open_


def warn_per_process_hashes(vllm_config: Any) -> None:
    """One warning when vLLM's block hashes are seeded per process: no other instance can hit the shared tier."""
    algo = str(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "sha256"))
    if algo.startswith("xxhash") and not os.environ.get("PYTHONHASHSEED"):
        log.warning("kvtier: prefix_caching_hash_algo=%s without PYTHONHASHSEED: vLLM seeds its block "
                    "hashes per process, so no other instance will ever hit this one's shared-tier "
                    "blocks; use sha256 or set the same PYTHONHASHSEED on every instance", algo)


def flush_budget_s(limit_s: float) -> float:
    """How long a worker may wait for its NVMe write-back at shutdown: within the grace vLLM's
    executor gives a worker to exit (VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS, default 5) before its
    SIGTERM, and never more than the worker's own bound `limit_s`."""
    try:
        grace = float(os.environ.get("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "5"))
    except ValueError:
        grace = 5.0
    return max(0.5, min(limit_s, grace - 1.0))


def short_totals(totals: dict) -> str:
    keys = (Metric.N_LOOKUPS.key, Metric.HIT_TOKENS.key, Metric.STORED_BLOCKS.at("cpu"), Metric.STORED_BLOCKS.at("nvme"),
            Metric.CORRUPT_BLOCKS.at("nvme"))
    return ", ".join(f"{k}={int(totals[k])}" for k in keys if totals.get(k))


def register_by_name(name: str, module: str) -> None:
    """Register the class under its name in vLLM's connector factory.

    Loaded by module path, an out-of-tree connector is not in the factory's registry; but as a
    child of MultiConnector its stats reach the API server as a dict keyed by class name, and
    MultiConnector rebuilds them with `get_connector_class_by_name`: unregistered, that raises
    in vLLM's output handler and the server fails the request and stops. This module is
    imported in that process (MultiConnector's build_prom_metrics loads its children), so
    registering here is enough."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        KVConnectorFactory.register_connector(name, module, name)
    except ValueError:  # already registered (vLLM may list it one day, or a re-import)
        pass
    except Exception as e:  # pragma: no cover - another vLLM
        log.warning("kvtier: could not register KVTierConnector with vLLM's connector factory: %s", e)
