"""What needs the machine: each nvme path checked (`check_environment`) and capacities that fit it
(`fit_to_machine`: shares of free memory and disk resolved, every tier checked against what is
available). It takes a `kvtier.core.config.StackConfig` (not imported here: config imports this
module to check what it loads)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from kvtier.core.errors import ConfigError

StackConfig = Any   # kvtier.core.config.StackConfig

HEADROOM_SHARE = 0.10                 # kept free of what kvtier sizes: 10% of the memory / the disk ...
HEADROOM_MIN = 2 << 30                # ... and at least 2 GiB
DISK_HEADROOM = 4 << 20               # per nvme tier: its index and spill manifest, ...
DISK_HEADROOM_PER_BLOCK = 512         # ... plus this per slot


def check_environment(cfg: StackConfig) -> None:
    """Checks that need the machine: each nvme path a writable directory of this user, not a
    symlink (the capacities are `fit_to_machine`'s)."""
    for i, t in enumerate(cfg.tiers):
        if t.kind != "nvme":
            continue
        field = f"tiers.{i}.path"
        p = Path(t.path)
        probe = _existing_ancestor(p)
        if not probe.is_dir():
            raise ConfigError(f"{cfg.source}: {field}: {probe} is not a directory [ENOTDIR]")
        if not os.access(probe, os.W_OK | os.X_OK):
            if os.statvfs(probe).f_flag & os.ST_RDONLY:
                raise ConfigError(f"{cfg.source}: {field}: {probe} is on a read-only file system [EROFS]")
            raise ConfigError(f"{cfg.source}: {field}: {probe} is not writable by this user [EACCES]")
        if os.path.islink(t.path):
            raise ConfigError(f"{cfg.source}: {field}: {t.path} is a symlink; refused")


def _existing_ancestor(p: Path) -> Path:
    p = Path(os.path.abspath(p))
    while not p.exists() and p.parent != p:
        p = p.parent
    return p


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, _, v = line.partition(":")
                parts = v.split()
                if parts and parts[0].isdigit():
                    out[k] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    except OSError:
        pass
    return out


def _cgroup_room() -> int | None:
    """Bytes this process's memory cgroup may still grow by (its limit minus what it uses, page
    cache it can drop counted as free), or None without a limit."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, ctrl, path = line.split(":", 2)
        if ctrl == "":                                   # v2
            base, files = f"/sys/fs/cgroup{path}", ("memory.max", "memory.current", "inactive_file")
        elif "memory" in ctrl.split(","):                # v1
            base, files = f"/sys/fs/cgroup/memory{path}", ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                                            "total_inactive_file")
        else:
            continue
        try:
            with open(os.path.join(base, files[0])) as f:
                raw = f.read().strip()
            if raw == "max" or int(raw) >= 1 << 60:
                continue
            with open(os.path.join(base, files[1])) as f:
                used = int(f.read())
            with open(os.path.join(base, "memory.stat")) as f:
                stat = dict(ln.split()[:2] for ln in f if ln.strip())
            return max(0, int(raw) - used + int(stat.get(files[2], 0)))
        except (OSError, ValueError):
            continue
    return None


def available_memory() -> int:
    """Bytes of memory this process can still take without swapping or an OOM kill: the kernel's
    MemAvailable (free memory plus page cache it can drop), lower when a memory cgroup limits
    this process; without /proc/meminfo, free pages (sysconf)."""
    mi = _meminfo()
    avail = mi.get("MemAvailable")
    if avail is None:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    room = _cgroup_room()
    return avail if room is None else min(avail, room)


def headroom(total: int) -> int:
    """What kvtier leaves free of a memory or a disk of `total` bytes: max(10%, 2 GiB)."""
    return max(int(total * HEADROOM_SHARE), HEADROOM_MIN)


def physical_memory() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def memory_headroom() -> int:
    """Memory kept free of DRAM tiers, however they are given: `headroom` of physical memory."""
    return headroom(physical_memory())


def disk_space(path: str | os.PathLike) -> tuple[int, int]:
    """(free bytes, total bytes) of the file system holding `path`."""
    u = shutil.disk_usage(path)
    return u.free, u.total


def _held_slots(path: str, stride: int) -> int:
    """Slots the tier's own data files already hold at `path` (space it can reuse)."""
    p = Path(path)
    if not p.is_dir():
        return 0
    sizes = [min(st.st_size, st.st_blocks * 512) for st in (f.stat() for f in p.glob("data.*") if f.is_file())]
    return max(sizes, default=0) // stride


def fit_to_machine(cfg: StackConfig, *, reserved_memory: int = 0, shrink: bool = False,
                   check: bool = True, kinds: tuple[str, ...] = ("cpu", "nvme")) -> tuple[StackConfig, list[str]]:
    """`cfg` with every share capacity ('25%') resolved, checked against this machine.

    A cpu tier's share is of the memory kvtier may use: `available_memory()` minus
    `reserved_memory` (what the caller will still allocate, e.g. vLLM's own KV cache) minus
    `memory_headroom()` (max(10%, 2 GiB) of the host's memory, kept free however the tier is
    given); the cpu tiers together must fit in it. An nvme tier's share is of the free space at its
    path plus its own data files, less max(10%, 2 GiB) of that disk (`headroom`) and
    `DISK_HEADROOM` (+ per slot) for the index and manifest, and never below the slots its data
    file already holds; the nvme tiers on one file system together must fit it. A tier that does not fit raises ConfigError naming
    the tier, the size asked and the size available, or, with `shrink`, comes back shrunk to fit
    with one warning line each (returned). `check=False` only resolves the shares (for commands
    that allocate nothing: inspect, fsck, metadata-only replay). `kinds`: the tiers to look at
    (the vLLM connector's scheduler checks the disk; its workers size their own DRAM pools)."""
    from kvtier.common.units import format_size as fs
    from kvtier.tiers.nvme_block import slot_stride
    bb = cfg.block_bytes
    stride = slot_stride(bb)
    blocks: dict[int, int] = {}           # tier index -> capacity in blocks, where resolved or changed
    warnings: list[str] = []

    def err(i: int, msg: str) -> ConfigError:
        return ConfigError(f"{cfg.source}: tiers.{i}.capacity: tier {cfg.tiers[i].name!r}: {msg}")

    cpu = [i for i, t in enumerate(cfg.tiers) if t.kind == "cpu" and "cpu" in kinds]
    if cpu:
        avail, keep = available_memory(), memory_headroom()
        budget = max(0, avail - reserved_memory - keep)
        how = (f"{fs(avail)} available{' (memory cgroup)' if _cgroup_room() is not None else ''}"
               f"{f' - {fs(reserved_memory)} reserved' if reserved_memory else ''} - {fs(keep)} kept free")
        want = {}
        for i in cpu:
            p = cfg.tiers[i].share()
            want[i] = int(budget * p) // bb if p is not None else cfg.tiers[i].blocks(bb)
            if want[i] <= 0:
                raise err(i, f"{cfg.tiers[i].capacity} of {fs(budget)} ({how}) holds no block of {fs(bb)}")
            if p is not None:
                blocks[i] = want[i]
        total = sum(want.values()) * bb
        if check and total > budget:
            what = (f"asks {fs(total)} of DRAM ({want[cpu[0]]} blocks)" if len(cpu) == 1 else
                    f"with the other cpu tiers asks {fs(total)} of DRAM")
            if not shrink or budget < bb * len(cpu):
                raise err(cpu[-1], f"{what}, only {fs(budget)} available to it ({how}); lower it or give a "
                                   f"share such as '50%'")
            for i in cpu:
                blocks[i] = max(1, want[i] * budget // total)
                warnings.append(f"kvtier: {cfg.source}: tiers.{i}.capacity: tier {cfg.tiers[i].name!r} shrunk "
                                f"from {fs(want[i] * bb)} to {fs(blocks[i] * bb)} of DRAM: {fs(budget)} "
                                f"available to it ({how})")

    disks: dict[int, dict] = {}           # st_dev -> free bytes, where, the nvme tiers on it
    held: dict[int, int] = {}
    for i, t in enumerate(cfg.tiers):
        if t.kind != "nvme" or "nvme" not in kinds:
            continue
        probe = _existing_ancestor(Path(t.path))
        try:
            dev = os.stat(probe).st_dev
            if dev not in disks:
                free, total = disk_space(probe)
                disks[dev] = {"free": free, "keep": headroom(total), "at": probe, "tiers": []}
            d = disks[dev]
        except OSError as e:
            raise ConfigError(f"{cfg.source}: tiers.{i}.path: {probe}: {e.strerror}") from None
        d["tiers"].append(i)
        held[i] = _held_slots(t.path, stride)
        p = t.share()
        if p is not None:   # a share of what is free beyond the headroom kvtier leaves on the disk
            usable = d["free"] + held[i] * stride - DISK_HEADROOM - d["keep"]
            blocks[i] = max(held[i], int(max(0, usable) * p) // (stride + DISK_HEADROOM_PER_BLOCK))
            if blocks[i] <= 0:
                raise err(i, f"{t.capacity} of the {fs(d['free'])} free at {probe}, less {fs(d['keep'])} kept "
                             f"free (max(10%, 2 GiB) of the disk), holds no slot of {fs(stride)}")
    for d in disks.values():
        idx = d["tiers"]
        usable = d["free"] + sum(held[i] for i in idx) * stride   # its own data files are reused
        n = {i: blocks.get(i) or cfg.tiers[i].blocks(bb) for i in idx}
        need = {i: n[i] * stride + DISK_HEADROOM + DISK_HEADROOM_PER_BLOCK * n[i] for i in idx}
        if not check or sum(need.values()) <= usable:
            continue
        for i in idx:
            others = sum(need[j] for j in idx if j != i)
            room = max(0, usable - others)
            fit = max(0, room - DISK_HEADROOM) // (stride + DISK_HEADROOM_PER_BLOCK)
            if fit >= n[i]:
                continue
            what = f"asks {fs(need[i])} of disk ({n[i]} slots of {fs(stride)} + index)"
            where = (f"only {fs(room)} available at {d['at']} (free space"
                     f"{' plus its data file' if held[i] else ''}"
                     f"{', beside the other nvme tiers there' if others else ''})")
            if not shrink or fit < max(1, held[i]):
                raise err(i, f"{what}, {where}; " + ("its data file already holds more: free space on that disk"
                                                     if fit < held[i] else "lower it or give a share such as '50%'"))
            warnings.append(f"kvtier: {cfg.source}: tiers.{i}.capacity: tier {cfg.tiers[i].name!r} shrunk from "
                            f"{n[i]} to {fit} slots ({fs(fit * stride)}): it {what}, {where}")
            blocks[i], need[i] = fit, fit * stride + DISK_HEADROOM + DISK_HEADROOM_PER_BLOCK * fit
    if not blocks:
        return cfg, warnings
    tiers = [t.model_copy(update={"capacity": None, "capacity_blocks": blocks[i]}) if i in blocks else t
             for i, t in enumerate(cfg.tiers)]
    return cfg.model_copy(update={"tiers": tiers}), warnings
