"""YAML tier-stack configuration: schema, defaults, and validation with errors that name the field."""

from __future__ import annotations

import os
import re
import shutil
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvtier.core.units import parse_size

DEFAULT_CONFIG = "cpu-nvme.yaml"


class ConfigError(ValueError):
    """A configuration problem; the message names the source, the field and the cause."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _size(v: Any) -> int:
    try:
        return parse_size(v)
    except ValueError as e:
        raise ValueError(str(e)) from None


class PolicyConfig(_Model):
    """Policies by registry name; `params` go to the classes' constructors."""

    eviction: str = "lru"
    admission: str = "all"
    promotion: str = "inclusive"
    demotion: Literal["write_through", "write_back"] = "write_through"
    offload: Literal["eager", "lazy"] = "eager"
    params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _known(self) -> "PolicyConfig":
        from kvtier.policies import ADMISSION, EVICTION, PROMOTION, retired
        for field, reg in (("eviction", EVICTION), ("admission", ADMISSION), ("promotion", PROMOTION)):
            name = getattr(self, field)
            if retired(name):
                raise ValueError(f"{field}: {retired(name)}")
            if name not in reg.classes and reg.classes:
                raise ValueError(f"{field}: unknown policy {name!r}; known: {', '.join(reg.names())}")
        _check_params(self.params, (EVICTION, ADMISSION, PROMOTION))
        return self


def _check_params(params: dict[str, Any], registries) -> None:
    """Each `params` entry names a known policy and only arguments its constructor takes."""
    import inspect
    from kvtier.policies import retired
    for name, p in params.items():
        classes = [reg.classes[name] for reg in registries if name in reg.classes]
        if not classes and retired(name):
            raise ValueError(f"params.{name}: {retired(name)}")
        if not classes:
            known = sorted({n for reg in registries for n in reg.classes})
            raise ValueError(f"params.{name}: unknown policy {name!r}; known: {', '.join(known)}")
        if not isinstance(p, dict):
            raise ValueError(f"params.{name}: expected a mapping of arguments, got {type(p).__name__}")
        for cls in classes:
            takes: dict[str, Any] = {}  # every named argument along the MRO (bases swallow **params)
            for c in cls.__mro__:
                init = c.__dict__.get("__init__")
                if init is None:
                    continue
                for a in inspect.signature(init).parameters.values():
                    if a.name not in ("self", "capacity") and a.kind not in (a.VAR_KEYWORD, a.VAR_POSITIONAL):
                        takes.setdefault(a.name, a.default)
            for k, v in p.items():
                if k not in takes:
                    raise ValueError(f"params.{name}.{k}: unknown parameter of policy {name!r}; "
                                     f"it takes: {', '.join(sorted(takes)) or 'none'}")
                d = takes[k]
                want = type(d) if isinstance(d, (bool, int, float, str)) else None
                ok = (want is None or (want is float and isinstance(v, (int, float)) and not isinstance(v, bool))
                      or (want is int and isinstance(v, int) and not isinstance(v, bool)) or
                      (want not in (int, float) and isinstance(v, want)))
                if not ok or isinstance(v, (dict, list)):
                    raise ValueError(f"params.{name}.{k}: expected {want.__name__ if want else 'a scalar'}, "
                                     f"got {type(v).__name__} {v!r}")


class TierConfig(_Model):
    name: str
    kind: Literal["gpu", "cpu", "nvme", "redis"]
    capacity: int | str | None = None  # bytes, or a share of free memory / disk ("25%", see fit_to_machine)
    capacity_blocks: int | None = None
    # cpu
    pin: Literal["auto", True, False] = "auto"
    # nvme
    path: str | None = None
    io: Literal["auto", "posix", "kvikio"] = "auto"
    io_threads: int = Field(default=4, ge=1, le=64)
    direct: Literal["auto", True, False] = "auto"   # O_DIRECT (auto: when the filesystem takes it)
    on_fingerprint_mismatch: Literal["refuse", "namespace"] = "refuse"
    # redis (the shared tier): server, client settings, the fleet's block secret
    url: str = "${KVTIER_REDIS_URL:-redis://localhost:6379/0}"
    cluster: bool = False              # a Redis Cluster (url names one node; the rest are discovered)
    username: str | None = None        # ACL user (or in the url); "${ENV}" is expanded
    password: str | None = None        # AUTH password (or in the url); "${ENV}" is expanded, never logged
    tls_ca: str | None = None          # CA file for rediss:// (default: the system's)
    timeout_s: float = Field(default=1.0, gt=0, le=60)          # per command; a slow server is a miss
    connect_timeout_s: float = Field(default=0.5, gt=0, le=60)
    pool_size: int = Field(default=16, ge=1, le=1024)           # connections per client
    batch_bytes: int = 16 << 20        # values per pipeline round trip
    secret: str | None = None          # the fleet's shared block secret ("${KVTIER_SHARED_SECRET}")
    # per-tier policy overrides
    eviction: str | None = None
    admission: str | None = None

    @field_validator("capacity", mode="before")
    @classmethod
    def _cap(cls, v: Any) -> Any:
        if isinstance(v, str) and "$" in v:
            v = expand_path(v)
        if isinstance(v, str) and v.strip().endswith("%"):
            try:
                p = float(v.strip()[:-1])
            except ValueError:
                raise ValueError(f"{v!r} is not a share (expected e.g. '25%')") from None
            if not 0 < p <= 100:
                raise ValueError(f"a share must be more than 0% and at most 100%, got {v!r}")
            return f"{p:g}%"
        return None if v is None else _size(v)

    @field_validator("batch_bytes", mode="before")
    @classmethod
    def _batch(cls, v: Any) -> int:
        n = _size(v)
        if not 1 << 16 <= n <= 1 << 30:
            raise ValueError("must be between 64 KiB and 1 GiB")
        return n

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        from urllib.parse import urlsplit
        u = urlsplit(expand_vars(v))
        if u.scheme not in ("redis", "rediss", "unix"):
            raise ValueError("must be a redis://, rediss:// or unix:// URL")
        return v

    @field_validator("capacity_blocks")
    @classmethod
    def _capb(cls, v: int | None) -> int | None:
        if v is not None and not 0 < v <= 1 << 40:
            raise ValueError(f"must be between 1 and 2**40, got {v}")
        return v

    @field_validator("eviction", "admission")
    @classmethod
    def _retired(cls, v: str | None) -> str | None:
        from kvtier.policies import retired
        if v and retired(v):
            raise ValueError(retired(v))
        return v

    @model_validator(mode="after")
    def _check(self) -> "TierConfig":
        if self.kind == "nvme" and not self.path:
            raise ValueError(f"tier {self.name!r}: kind nvme needs a path")
        if self.kind not in ("gpu", "redis") and self.capacity is None and self.capacity_blocks is None:
            raise ValueError(f"tier {self.name!r}: give capacity (e.g. 2GiB) or capacity_blocks")
        if self.capacity is not None and self.capacity_blocks is not None:
            raise ValueError(f"tier {self.name!r}: give capacity or capacity_blocks, not both")
        if isinstance(self.capacity, str) and self.kind not in ("cpu", "nvme"):
            raise ValueError(f"tier {self.name!r}: a share ({self.capacity}) is for cpu and nvme tiers; "
                             f"give a {self.kind} tier a size")
        return self

    def share(self) -> float | None:
        """A capacity given as a share of what is free ('25%' -> 0.25); None for a size."""
        return float(self.capacity[:-1]) / 100 if isinstance(self.capacity, str) else None

    def blocks(self, block_bytes: int) -> int:
        if self.kind == "redis" and self.capacity is None and self.capacity_blocks is None:
            return 0  # the server's memory decides (replay models it as unbounded)
        if self.capacity_blocks is not None:
            return self.capacity_blocks
        if isinstance(self.capacity, str):
            raise ConfigError(f"tiers[{self.name}].capacity: {self.capacity} is a share of this machine's free "
                              f"{'memory' if self.kind == 'cpu' else 'disk'}: resolve it with "
                              f"kvtier.core.config.fit_to_machine first")
        n = (self.capacity or 0) // block_bytes
        if n <= 0:
            raise ConfigError(f"tiers[{self.name}].capacity: {self.capacity} bytes holds no block of {block_bytes} bytes")
        return n


class ServingConfig(_Model):
    """Settings of the vLLM connector (ignored offline)."""

    store: bool = True                 # False: load only, never store
    lease_timeout_s: float = Field(default=300.0, gt=0)
    nvme_write_lag_steps: int = Field(default=4, ge=0)  # NVMe writes reported within N steps (0: in the step)
    max_blocks_per_step: int = 64      # lazy offload bound per scheduler step (<= 0: unbounded)
    async_shared_loads: bool = True    # a shared-tier hit loads while the request waits (no step waits)


class StackConfig(_Model):
    block_bytes: int = 262144
    block_tokens: int = 512
    model: str = "unknown"
    dtype: str = "unknown"
    layout: str = "unknown"
    rank: int = 0
    writeback_bytes: int = 64 << 20
    tiers: list[TierConfig]
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    serving: ServingConfig = Field(default_factory=ServingConfig)
    source: str = Field(default="<dict>", exclude=True)

    @field_validator("block_bytes", "writeback_bytes", mode="before")
    @classmethod
    def _bb(cls, v: Any) -> int:
        n = _size(v)
        if not 0 < n <= 1 << 32:
            raise ValueError("must be > 0 and at most 4 GiB")
        return n

    @model_validator(mode="after")
    def _tiers(self) -> "StackConfig":
        if not self.tiers:
            raise ValueError("tiers: at least one tier is needed")
        names = [t.name for t in self.tiers]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"tiers: duplicate tier names {sorted(dup)}")
        seen: dict[str, str] = {}
        for t in self.tiers:
            if t.kind == "nvme" and t.path:
                real = os.path.realpath(os.path.expanduser(t.path))
                if real in seen:
                    raise ValueError(f"tiers: nvme tiers {seen[real]!r} and {t.name!r} share the directory {real} "
                                     f"(each needs its own)")
                seen[real] = t.name
        order = {"gpu": 0, "cpu": 1, "nvme": 2, "redis": 3}
        ranks = [order[t.kind] for t in self.tiers]
        if ranks != sorted(ranks):
            raise ValueError("tiers: list them fastest first (gpu, cpu, nvme, redis)")
        if sum(t.kind == "redis" for t in self.tiers) > 1:
            raise ValueError("tiers: at most one redis tier (the shared tier, the lowest)")
        if self.tiers[0].kind == "redis" or all(t.kind in ("gpu", "redis") for t in self.tiers):
            raise ValueError("tiers: a redis tier needs a cpu tier above it (blocks reach the server from DRAM)")
        if sum(t.kind == "gpu" for t in self.tiers) > 1:
            raise ValueError("tiers: at most one gpu tier")
        return self

    def storage_tiers(self) -> list[TierConfig]:
        """The tiers kvtier owns (the gpu tier is vLLM's block pool)."""
        return [t for t in self.tiers if t.kind != "gpu"]

    def fingerprint(self, **overrides: Any) -> dict[str, Any]:
        from kvtier import FORMAT_VERSION
        fp = {"block_bytes": self.block_bytes, "block_tokens": self.block_tokens, "model": self.model,
              "dtype": self.dtype, "layout": self.layout, "rank": self.rank, "format_version": FORMAT_VERSION}
        fp.update(overrides)
        return fp


def _format_validation(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        got = e.get("input")
        scalar = e["type"] not in ("extra_forbidden", "missing") and isinstance(got, (str, int, float, bool))
        lines.append(f"{loc}: {msg}" + (f" (got {got!r})" if scalar and ", got " not in msg else ""))
    return f"{source}: invalid configuration\n  " + "\n  ".join(lines)


def parse_config(data: Any, source: str = "<dict>", check_env: bool = True) -> StackConfig:
    """The validated stack of `data`; `check_env`: its paths checked and its capacities resolved
    and checked against this machine (`check_environment`, `fit_to_machine`), else shares stay
    unresolved until the caller runs `fit_to_machine`."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        cfg = StackConfig.model_validate({**data, "source": source})
    except ValidationError as e:
        raise ConfigError(_format_validation(e, source)) from None
    for t in cfg.tiers:
        if t.path:
            t.path = expand_path(t.path)
        if t.kind == "redis":
            t.url = expand_vars(t.url)
            for f in ("username", "password", "secret", "tls_ca"):
                v = getattr(t, f)
                if v and "$" in v:
                    setattr(t, f, (expand_path if f == "tls_ca" else expand_vars)(v) or None)
    if check_env:
        check_environment(cfg)
        cfg, _ = fit_to_machine(cfg)
    return cfg


_VAR = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}|\$(\w+)")


def expand_vars(value: str) -> str:
    """Expand $VAR, ${VAR} and ${VAR:-default}."""
    def sub(m: re.Match) -> str:
        name = m.group(1) or m.group(3)
        return os.environ.get(name) or (m.group(2) or "")
    return _VAR.sub(sub, value)


def expand_path(value: str) -> str:
    """Expand ~, $VAR, ${VAR} and ${VAR:-default}."""
    return os.path.expanduser(expand_vars(value))


MAX_CONFIG_BYTES = 1 << 20
MAX_DEPTH = 32


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader without aliases (no billion-laughs) and with a nesting limit (no RecursionError)."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            ev = self.peek_event()
            raise ConfigError(f"{self.name}: line {ev.start_mark.line + 1}: YAML aliases (*{ev.anchor}) "
                              f"are not allowed in a config")
        self._depth = getattr(self, "_depth", 0) + 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise ConfigError(f"{self.name}: line {mark.line + 1}: nested deeper than {MAX_DEPTH} levels")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


MAX_INT_DIGITS = 64


def _check_nodes(node: yaml.Node, source: str, where: str) -> None:
    """Before anything is built from the YAML: no key twice in one mapping, no integer longer
    than MAX_INT_DIGITS digits (Python refuses to convert one of 4300 without naming the field)."""
    def at(n: yaml.Node, loc: str) -> str:
        return f"{source}: line {n.start_mark.line + 1}: {loc or '(top level)'}"
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for k, v in node.value:
            key = str(k.value) if isinstance(k, yaml.ScalarNode) else "?"
            loc = f"{where}.{key}" if where else key
            if key in seen:
                raise ConfigError(f"{at(k, loc)}: duplicate key {key!r} (first at line {seen[key]})")
            seen[key] = k.start_mark.line + 1
            _check_nodes(v, source, loc)
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            _check_nodes(v, source, f"{where}.{i}" if where else str(i))
    elif node.tag == "tag:yaml.org,2002:int":
        digits = sum(c.isdigit() for c in str(node.value))
        if digits > MAX_INT_DIGITS:
            raise ConfigError(f"{at(node, where)}: an integer of {digits} digits; not a value of any field")


def load_config(path: str | os.PathLike | None = None, check_env: bool = True) -> StackConfig:
    """Load a YAML stack; None or a bare shipped name ('cpu-nvme') loads an embedded config.
    Bounded: at most 1 MiB, 32 levels of nesting, no aliases."""
    text, source = _read(path)
    try:
        loader = _BoundedLoader(text)
        loader.name = source
        try:
            node = loader.get_single_node()
            if node is not None:
                _check_nodes(node, source, "")
            data = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except RecursionError:
        raise ConfigError(f"{source}: nested too deeply") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1} column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{source}:{where} not valid YAML: {getattr(e, 'problem', e)}") from None
    return parse_config(data, source, check_env)


def shipped_configs() -> list[str]:
    return sorted(p.name for p in resources.files("kvtier.configs").iterdir() if p.name.endswith(".yaml"))


def _read(path: str | os.PathLike | None) -> tuple[str, str]:
    if path is None:
        path = DEFAULT_CONFIG
    p = Path(path)
    if p.is_file():
        try:
            with open(p, "rb") as f:
                raw = f.read(MAX_CONFIG_BYTES + 1)
        except OSError as e:
            raise ConfigError(f"{p}: cannot read: {e.strerror}") from None
        if len(raw) > MAX_CONFIG_BYTES:
            raise ConfigError(f"{p}: larger than {MAX_CONFIG_BYTES} bytes; not a config")
        try:
            return raw.decode(), str(p)
        except UnicodeDecodeError as e:
            raise ConfigError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    name = p.name if p.name.endswith(".yaml") else p.name + ".yaml"
    if len(p.parts) == 1 and name in shipped_configs():
        return resources.files("kvtier.configs").joinpath(name).read_text(), f"<shipped {name}>"
    if p.exists():
        raise ConfigError(f"{p}: not a regular file")
    raise ConfigError(f"{p}: no such config file (shipped configs: {', '.join(shipped_configs())})")


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


def _stride(block_bytes: int) -> int:
    from kvtier.tiers.nvme_block import slot_stride
    return slot_stride(block_bytes)


# ---- capacities that fit the machine ----------------------------------------------------------
MEMORY_HEADROOM_SHARE = 0.05          # of physical memory, kept free of DRAM tiers ...
MEMORY_HEADROOM_MIN = 256 << 20       # ... at least 256 MiB
MEMORY_HEADROOM_MAX = 4 << 30         # ... at most 4 GiB
DISK_HEADROOM = 4 << 20               # per nvme tier: its index and spill manifest, ...
DISK_HEADROOM_PER_BLOCK = 512         # ... plus this per slot


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


def memory_headroom() -> int:
    """Memory kept free of DRAM tiers: 5% of physical memory, between 256 MiB and 4 GiB."""
    phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(min(MEMORY_HEADROOM_MAX, max(MEMORY_HEADROOM_MIN, phys * MEMORY_HEADROOM_SHARE)))


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
    `memory_headroom()`; the cpu tiers together must fit in it. An nvme tier's share is of the
    free space at its path plus its own data files, less `DISK_HEADROOM` (+ per slot) for the
    index and manifest, and never below the slots its data file already holds; the nvme tiers
    on one file system together must fit it. A tier that does not fit raises ConfigError naming
    the tier, the size asked and the size available, or, with `shrink`, comes back shrunk to fit
    with one warning line each (returned). `check=False` only resolves the shares (for commands
    that allocate nothing: inspect, fsck, metadata-only replay). `kinds`: the tiers to look at
    (the vLLM connector's scheduler checks the disk; its workers size their own DRAM pools)."""
    from kvtier.core.units import format_size as fs
    bb = cfg.block_bytes
    stride = _stride(bb)
    blocks: dict[int, int] = {}           # tier index -> capacity in blocks, where resolved or changed
    warnings: list[str] = []

    def err(i: int, msg: str) -> ConfigError:
        return ConfigError(f"{cfg.source}: tiers.{i}.capacity: tier {cfg.tiers[i].name!r}: {msg}")

    cpu = [i for i, t in enumerate(cfg.tiers) if t.kind == "cpu" and "cpu" in kinds]
    if cpu:
        avail, headroom = available_memory(), memory_headroom()
        budget = max(0, avail - reserved_memory - headroom)
        how = (f"{fs(avail)} available{' (memory cgroup)' if _cgroup_room() is not None else ''}"
               f"{f' - {fs(reserved_memory)} reserved' if reserved_memory else ''} - {fs(headroom)} headroom")
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
            d = disks.setdefault(os.stat(probe).st_dev, {"free": shutil.disk_usage(probe).free, "at": probe,
                                                         "tiers": []})
        except OSError as e:
            raise ConfigError(f"{cfg.source}: tiers.{i}.path: {probe}: {e.strerror}") from None
        d["tiers"].append(i)
        held[i] = _held_slots(t.path, stride)
        p = t.share()
        if p is not None:
            usable = d["free"] + held[i] * stride - DISK_HEADROOM
            blocks[i] = max(held[i], int(max(0, usable) * p) // (stride + DISK_HEADROOM_PER_BLOCK))
            if blocks[i] <= 0:
                raise err(i, f"{t.capacity} of the {fs(d['free'])} free at {probe} holds no slot of {fs(stride)}")
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
