"""YAML tier-stack configuration: schema, defaults, and validation with errors that name the field."""

from __future__ import annotations

import os
import re
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvtier.core.errors import ConfigError
from kvtier.core.fit import check_environment, fit_to_machine
from kvtier.core.tenants_config import TenantsConfig, check_tenants
from kvtier.tiers.redact import redact
from kvtier.common.units import parse_size

DEFAULT_CONFIG = "cpu-nvme.yaml"


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


class KeySource(_Model):
    """Where an AES-256 key comes from: a file (0600; exactly 32 raw bytes or 64 hex digits) or a
    variable (64 hex digits); read and checked by `tiers/sealing.py` when the tier is built."""

    key_file: str | None = None
    key_env: str | None = None

    @model_validator(mode="after")
    def _one(self) -> "KeySource":
        if (self.key_file is None) == (self.key_env is None):
            raise ValueError("give key_file or key_env (one of them)")
        if self.key_file:
            self.key_file = expand_path(self.key_file)
        return self


class EncryptionConfig(KeySource):
    """A persistent tier's encryption at rest (`tiers/sealing.py`); `read_keys`: old keys still read."""

    read_keys: list[KeySource] = Field(default_factory=list, max_length=16)


class TierConfig(_Model):
    name: str
    kind: Literal["gpu", "cpu", "nvme", "shared"]   # "redis": the older name of "shared"
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
    # shared (the fleet's Redis/Valkey server): server, client settings, the fleet's block secret
    url: str = "${KVTIER_REDIS_URL:-redis://localhost:6379/0}"
    cluster: bool = False              # a Redis Cluster (url names one node; the rest are discovered)
    username: str | None = None        # ACL user (or in the url); "${ENV}" is expanded
    password: str | None = Field(default=None, repr=False)  # AUTH password (or in the url); "${ENV}" is
                                                            # expanded; never printed
    tls_ca: str | None = None          # CA file for rediss:// (default: the system's)
    timeout_s: float = Field(default=1.0, gt=0, le=60)          # per command; a slow server is a miss
    connect_timeout_s: float = Field(default=0.5, gt=0, le=60)
    pool_size: int = Field(default=16, ge=1, le=1024)           # connections per client
    batch_bytes: int = 16 << 20        # values per pipeline round trip
    secret: str | None = Field(default=None, repr=False)  # the fleet's block secret ("${KVTIER_SHARED_SECRET}")
    encryption: EncryptionConfig | None = None   # nvme, shared: AES-256-GCM at rest
    # per-tier policy overrides
    eviction: str | None = None
    admission: str | None = None

    @field_validator("kind", mode="before")
    @classmethod
    def _kind(cls, v: Any) -> Any:
        return "shared" if v == "redis" else v   # the shared tier's older name, still read

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

    def __repr_args__(self):   # the url without its password; no password or secret (repr=False)
        return [(k, redact(v) if k == "url" else v) for k, v in super().__repr_args__()]

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
        if self.kind not in ("gpu", "shared") and self.capacity is None and self.capacity_blocks is None:
            raise ValueError(f"tier {self.name!r}: give capacity (e.g. 2GiB) or capacity_blocks")
        if self.capacity is not None and self.capacity_blocks is not None:
            raise ValueError(f"tier {self.name!r}: give capacity or capacity_blocks, not both")
        if self.encryption is not None and self.kind not in ("nvme", "shared"):
            raise ValueError(f"tier {self.name!r}: encryption is for the persistent tiers (nvme, shared)")
        if self.encryption is not None and self.io == "kvikio":
            raise ValueError(f"tier {self.name!r}: encryption needs io: posix or auto (io: kvikio moves blocks "
                             f"between the file and device memory, with no host copy to encrypt)")
        if isinstance(self.capacity, str) and self.kind not in ("cpu", "nvme"):
            raise ValueError(f"tier {self.name!r}: a share ({self.capacity}) is for cpu and nvme tiers; "
                             f"give a {self.kind} tier a size")
        return self

    def share(self) -> float | None:
        """A capacity given as a share of what is free ('25%' -> 0.25); None for a size."""
        return float(self.capacity[:-1]) / 100 if isinstance(self.capacity, str) else None

    def blocks(self, block_bytes: int) -> int:
        if self.kind == "shared" and self.capacity is None and self.capacity_blocks is None:
            return 0  # the server's memory decides (replay models it as unbounded)
        if self.capacity_blocks is not None:
            return self.capacity_blocks
        if isinstance(self.capacity, str):
            raise ConfigError(f"tiers[{self.name}].capacity: {self.capacity} is a share of this machine's free "
                              f"{'memory' if self.kind == 'cpu' else 'disk'}: resolve it with "
                              f"kvtier.core.fit.fit_to_machine first")
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
    parallel_agnostic: bool = True     # blocks any TP size can read where certified (connector/canonical.py)
    record_trace: str | None = None    # record the traffic here (connector/recorder.py; for `kvtier plan`)
    record_max_bytes: int = 256 << 20  # ... rotated at this size (the previous file kept as PATH.1)
    model_identity: str | None = Field(default=None, min_length=1, max_length=256)  # names the weights (no digest)
    data_dir: str | None = None        # the weights' digest cache (default $KVTIER_DATA_DIR or ~/.cache/kvtier)

    @field_validator("record_max_bytes", mode="before")
    @classmethod
    def _rmb(cls, v: Any) -> int:
        n = _size(v)
        if n < 4096:
            raise ValueError("must be at least 4 KiB")
        return n


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
    tenants: TenantsConfig | None = None   # per-tenant quotas (kvtier/core/tenants_config.py)
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
        order = {"gpu": 0, "cpu": 1, "nvme": 2, "shared": 3}
        ranks = [order[t.kind] for t in self.tiers]
        if ranks != sorted(ranks):
            raise ValueError("tiers: list them fastest first (gpu, cpu, nvme, shared)")
        if sum(t.kind == "shared" for t in self.tiers) > 1:
            raise ValueError("tiers: at most one shared tier (the lowest)")
        if self.tiers[0].kind == "shared" or all(t.kind in ("gpu", "shared") for t in self.tiers):
            raise ValueError("tiers: a shared tier needs a cpu tier above it (blocks reach the server from DRAM)")
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


_UNSHOWN = ("password", "secret")   # fields whose value an error never echoes


def _format_validation(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        got = e.get("input")
        scalar = e["type"] not in ("extra_forbidden", "missing") and isinstance(got, (str, int, float, bool))
        if scalar and str(e["loc"][-1]) in _UNSHOWN:   # a credential: its type, never its value
            got, scalar = None, False
            msg += f" (got {type(e.get('input')).__name__}: not shown)"
        lines.append(redact(f"{loc}: {msg}" + (f" (got {got!r})" if scalar and ", got " not in msg else "")))
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
    check_tenants(cfg)
    for t in cfg.tiers:
        if t.path:
            t.path = expand_path(t.path)
        if t.kind == "shared":
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
