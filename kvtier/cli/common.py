"""What the CLI commands share: the fitted config, the result printed as text or JSON, the
failure that still prints its result, progress bars, staging buffers, and the config's NVMe tier
opened read-only."""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
from typing import Any

from kvtier.core.config import ConfigError, StackConfig, load_config
from kvtier.core.fit import check_environment, fit_to_machine


class CommandFailed(RuntimeError):
    """The command ran but its result is a failure (exit 1); `result` is still printed."""

    def __init__(self, message: str, result: dict | None = None, code: int = 1) -> None:
        super().__init__(message)
        self.result = result
        self.code = code


def load_fitted(path: str | None, allocate: bool) -> StackConfig:
    """The config at `path` with its capacities resolved (`fit_to_machine`); `allocate`: the
    command builds its tiers, so paths and capacities are checked against this machine first
    (a tier that does not fit is one error naming it, never an OOM kill or ENOSPC later)."""
    cfg = load_config(path, check_env=False)
    if allocate:
        check_environment(cfg)
    return fit_to_machine(cfg, check=allocate)[0]


def check_seed(seed: int | None) -> None:
    if seed is not None and not 0 <= seed < 1 << 63:
        raise ValueError(f"--seed must be in [0, 2**63), got {seed}")


def print_result(args: argparse.Namespace, result: dict, text) -> None:
    """`result` as JSON (--json) or as `text(result)`; through `redact`: never a password."""
    from kvtier.tiers.redact import redact, redact_all
    if args is not None and getattr(args, "json", False):
        print(json.dumps(redact_all(result), default=str), flush=True)
    else:
        print(redact(text(result)), flush=True)


def progress(args: argparse.Namespace, total: int, desc: str):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="blk", disable=args.quiet or args.json or None,
                file=sys.stderr, dynamic_ncols=True)


def staging_pool(num: int, block_bytes: int):
    from kvtier.tiers.cpu_pool import CpuPool
    return CpuPool(num, block_bytes, pin="auto")


def engine_name(tier: Any) -> str:
    return tier.stats().get("engine", "?")


def nvme_tier_config(cfg: StackConfig):
    for t in cfg.tiers:
        if t.kind == "nvme":
            return t
    raise ConfigError(f"{cfg.source}: tiers: this command needs an nvme tier")


def open_nvme_read_only(cfg: StackConfig, with_data: bool = True, as_stored: bool = False):
    """The config's NVMe tier opened read-only: no lock taken, nothing created, sized or
    allocated beyond one I/O engine (works on a live server's directory). `as_stored` (the
    index alone): open it under the fingerprint, block size and capacity it was written with
    (e.g. by the vLLM connector, whose fingerprint names the model), not the config's."""
    from kvtier.core.builder import make_eviction, tier_sealer
    from kvtier.tiers.nvme import NvmeTier
    from kvtier.tiers.nvme_control import NvmeControl
    t = nvme_tier_config(cfg)
    if not os.path.isdir(t.path):
        raise OSError(errno.ENOENT, f"no nvme tier at {t.path} (nothing was spilled there)", t.path)
    cap = t.blocks(cfg.block_bytes)
    if not with_data:  # the index alone
        fp, bb = cfg.fingerprint(), cfg.block_bytes
        stored = stored_layout(t.path) if as_stored else None
        if stored is not None:
            fp, bb = stored["fingerprint"], int(stored["fingerprint"].get("block_bytes", bb))
            cap = int(stored.get("capacity") or cap)
        return NvmeControl(t.name, t.path, cap, bb, make_eviction(cfg, t, cap),
                           fingerprint=fp, on_mismatch=t.on_fingerprint_mismatch, read_only=True)
    return NvmeTier(t.name, t.path, cap, cfg.block_bytes, make_eviction(cfg, t, cap), io=t.io,
                    fingerprint=cfg.fingerprint(), on_mismatch=t.on_fingerprint_mismatch,
                    io_threads=t.io_threads, read_only=True, with_data=with_data, sealer=tier_sealer(cfg, t))


def stored_layout(path: str) -> dict | None:
    """The fingerprint and capacity an NVMe tier directory was written with (read-only), or None."""
    from kvtier.tiers.nvme_index import NvmeIndex
    idx = os.path.join(path, "index")
    if not os.path.isfile(os.path.join(idx, "data.mdb")):
        return None
    ix = NvmeIndex(idx, 1, read_only=True)
    try:
        fp = ix.fingerprint()
        return None if fp is None else {"fingerprint": fp, "capacity": ix.get_meta("capacity")}
    finally:
        ix.close()
