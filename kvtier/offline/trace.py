"""Mooncake-format request traces: one JSON object per line.

Each line: ``timestamp`` (ms from start, number), ``input_length`` and ``output_length``
(tokens, non-negative ints) and ``hash_ids`` (list of non-negative ints: chained hashes of
``block_tokens``-token blocks; a block id stands for its whole prefix). An optional
``block_tokens`` key (a positive int) gives the block size; absent, it is 512 (the Mooncake
default). Every line of one trace has the same block size: all lines give the same value, or
none gives it. A trace kvtier recorded (connector/recorder.py) starts each session with a header
line ``{"kvtier_trace": {"block_tokens", "block_bytes", "model", "kv_dtype", "session", ...}}``:
the geometry the server stored its blocks in, which `plan` and `replay` use over the config's.
A trace whose lengths contradict its block size, or that mixes geometries, is refused (one
line naming the path, the line and the field). An optional ``tenant`` (a non-empty string of at most
256 characters) names the request's tenant (`kvtier replay` and `kvtier plan` report per tenant).
"""

from __future__ import annotations

import gzip
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from kvtier.core.keys import make_key

BLOCK_TOKENS = 512
MAX_BLOCK_TOKENS = 1 << 20
BUNDLED = "mooncake_conversation.jsonl.gz"  # package data: Mooncake FAST'25 conversation trace (NOTICE)


def bundled_trace() -> Path:
    """The Mooncake conversation trace shipped inside the package (gzipped)."""
    return Path(__file__).resolve().parent.parent / "data" / BUNDLED


def default_trace() -> Path:
    """$KVTIER_TRACE when set, else the bundled trace."""
    env = os.environ.get("KVTIER_TRACE")
    return Path(env) if env else bundled_trace()


class TraceError(ValueError):
    """A malformed trace line; the message names the file, line number and field."""


@dataclass(frozen=True, slots=True)
class Request:
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    tenant: str | None = None

    def last_full(self, block_tokens: int = BLOCK_TOKENS) -> bool:
        """Whether the request's last block holds a full block of input tokens."""
        return self.input_length >= len(self.hash_ids) * block_tokens


def _int_field(obj: dict, name: str, where: str) -> int:
    if name not in obj:
        raise TraceError(f"{where}: missing field {name!r}")
    v = obj[name]
    if isinstance(v, bool) or not isinstance(v, int):
        raise TraceError(f"{where}: field {name!r} must be an integer, got {type(v).__name__} {v!r}")
    if v < 0:
        raise TraceError(f"{where}: field {name!r} must be >= 0, got {v}")
    return v


def parse_request(obj: object, where: str = "request") -> Request:
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if "timestamp" not in obj:
        raise TraceError(f"{where}: missing field 'timestamp'")
    ts = obj["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
        raise TraceError(f"{where}: field 'timestamp' must be a finite non-negative number, got {ts!r}")
    inp = _int_field(obj, "input_length", where)
    out = _int_field(obj, "output_length", where)
    if "hash_ids" not in obj:
        raise TraceError(f"{where}: missing field 'hash_ids'")
    h = obj["hash_ids"]
    if not isinstance(h, list):
        raise TraceError(f"{where}: field 'hash_ids' must be a list, got {type(h).__name__}")
    for i, x in enumerate(h):
        if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < 1 << 64:
            raise TraceError(f"{where}: field 'hash_ids'[{i}] must be an integer in [0, 2**64), got {x!r}")
    ten = obj.get("tenant")
    if ten is not None and (not isinstance(ten, str) or not 0 < len(ten) <= 256):
        raise TraceError(f"{where}: field 'tenant' must be a string of 1 to 256 characters, got {ten!r:.80}")
    return Request(float(ts), inp, out, tuple(h), ten)


class Trace(list):
    """The requests of one trace (a list) and the block size of its hash ids."""

    def __init__(self, reqs: Iterable[Request] = (), block_tokens: int = BLOCK_TOKENS) -> None:
        super().__init__(reqs)
        self.block_tokens = block_tokens
        self.geometry: dict | None = None   # the recorder's header (block tokens and bytes, model, KV dtype)
        self.warnings: list[str] = []


def _block_tokens(obj: dict, where: str) -> int | None:
    if "block_tokens" not in obj:
        return None
    v = obj["block_tokens"]
    if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= MAX_BLOCK_TOKENS:
        raise TraceError(f"{where}: field 'block_tokens' must be an integer in [1, {MAX_BLOCK_TOKENS}], got {v!r}")
    return v


GEOMETRY_KEY = "kvtier_trace"   # a header line (the recorder's): the geometry the server stored the blocks in
GEOMETRY_FIELDS = ("block_tokens", "block_bytes", "model", "kv_dtype")
CHECK_REQUESTS = 2000          # requests of >= 2 blocks the length check looks at (the first ones)
FAR = 2.0                      # input_length off len(hash_ids) x block_tokens by this factor contradicts it


def _geometry(obj: dict, where: str) -> dict:
    g = obj.get(GEOMETRY_KEY)
    if not isinstance(g, dict):
        raise TraceError(f"{where}: field {GEOMETRY_KEY!r} must be an object, got {type(g).__name__}")
    out = {k: g[k] for k in (*GEOMETRY_FIELDS, "dtype", "session", "prefill_tokens_per_s", "prefill_steps", "version")
           if k in g}
    _block_tokens(out, where)
    for k in ("block_bytes", "session"):
        v = out.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise TraceError(f"{where}: field {GEOMETRY_KEY}.{k} must be a positive integer, got {v!r}")
    v = out.get("prefill_tokens_per_s")
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1e12):
        raise TraceError(f"{where}: field {GEOMETRY_KEY}.prefill_tokens_per_s must be a number > 0, got {v!r}")
    return out


def implied_block_tokens(ratios: list[float]) -> tuple[int, float]:
    """(the power of two nearest the median, the median) of input_length / len(hash_ids)."""
    med = sorted(ratios)[len(ratios) // 2]
    return 1 << max(0, round(math.log2(max(med, 1.0)))), med


class TraceReader:
    """Stream a Mooncake JSONL trace (plain or .gz) request by request, in file order; blank lines
    are skipped; errors name path, line and field. `block_tokens` is the trace's block size once
    the first request is read (BLOCK_TOKENS when the trace gives none); a line whose block size
    differs from the first line's is an error naming both lines. `geometry`: the recorder's header
    (block tokens and bytes, model, KV dtype as the server stored them), None without one; a
    second header with another geometry is an error (a mixed trace). A last line cut short (no
    newline: the writer stopped mid-line) that does not parse is skipped with a warning.

    Lengths: when most of the first CHECK_REQUESTS requests of >= 2 blocks have an input_length
    more than FAR x off len(hash_ids) x block_tokens, the block size is wrong for these ids: an
    error naming the field and the block size the lengths imply, unless `trust_block_tokens`.
    `warnings` (filled as the trace is read): what was skipped, requests that repeat a block id."""

    def __init__(self, path: str | os.PathLike, limit: int | None = None, trust_block_tokens: bool = False) -> None:
        self.path = path
        self.limit = limit
        self.trust = trust_block_tokens
        self.block_tokens = BLOCK_TOKENS
        self.declared = False            # the trace states its block size (a field or a header)
        self.geometry: dict | None = None
        self.warnings: list[str] = []
        self.repeated = 0                # requests that repeat a block id inside the request

    def _lines(self, path: str) -> Iterator[tuple[int, bytes, bool]]:
        """(line number, raw line, whether it ended with a newline)."""
        try:
            f = gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")
        except OSError as e:
            raise TraceError(f"{path}: cannot open: {e.strerror or e} [{_errno(e)}]") from None
        with f:
            lineno = 0
            try:
                for raw in f:
                    lineno += 1
                    yield lineno, raw, raw.endswith(b"\n")
            except (OSError, EOFError, gzip.BadGzipFile) as e:   # a damaged .gz, an I/O error
                raise TraceError(f"{path}:{lineno + 1}: cannot read: {e}") from None

    def __iter__(self) -> Iterator[Request]:
        path = os.fspath(self.path)
        first: tuple[int, int | None] | None = None   # (line, declared block_tokens) of the first request
        head: tuple[int, dict] | None = None          # (line, geometry) of the first header
        ratios: list[float] = []
        far = 0
        checked = self.trust
        first_repeat = 0
        n = 0
        if self.limit is not None and self.limit <= 0:
            return
        for lineno, raw, whole in self._lines(path):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError as e:
                if not whole:
                    self.warnings.append(f"{where}: skipped a torn last line (no newline at its end)")
                    break
                raise TraceError(f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                                 f"a trace is JSON lines") from None
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                if not whole:
                    self.warnings.append(f"{where}: skipped a torn last line (no newline at its end; the writer "
                                         f"stopped mid-line)")
                    break
                raise TraceError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            if isinstance(obj, dict) and GEOMETRY_KEY in obj:
                g = _geometry(obj, where)
                if head is None:
                    head = (lineno, g)
                    self.geometry = g
                else:
                    for k in GEOMETRY_FIELDS:
                        if g.get(k) != head[1].get(k):
                            raise TraceError(f"{where}: a mixed trace: {k} {g.get(k)!r} here, {head[1].get(k)!r} "
                                             f"at line {head[0]} (recorded under another geometry); give plan or "
                                             f"replay one part")
                    if "prefill_tokens_per_s" in g:   # the latest measure wins
                        self.geometry = {**self.geometry, **{k: g[k] for k in ("prefill_tokens_per_s",
                                                                                  "prefill_steps") if k in g}}
                continue
            req = parse_request(obj, where)
            bt = _block_tokens(obj, where)
            if bt is None and head is not None:
                bt = head[1].get("block_tokens")
            if first is None:
                first = (lineno, bt)
                self.block_tokens = bt or BLOCK_TOKENS
                self.declared = bt is not None
            elif bt != first[1]:
                def say(v: int | None) -> str:
                    return f"block_tokens {v}" if v is not None else f"no block_tokens ({BLOCK_TOKENS})"
                raise TraceError(f"{where}: {say(bt)}, but line {first[0]} has {say(first[1])}: every line of "
                                 f"a trace has the same block size")
            h = req.hash_ids
            if len(h) > 1 and len(set(h)) != len(h):
                self.repeated += 1
                first_repeat = first_repeat or lineno
            if not checked and len(h) >= 2:
                r = req.input_length / (len(h) * self.block_tokens)
                far += not (1 / FAR <= r <= FAR)
                ratios.append(req.input_length / len(h))
                if len(ratios) >= CHECK_REQUESTS:
                    checked = True
                    self._check(far, ratios, path)
            yield req
            n += 1
            if self.limit is not None and n >= self.limit:
                break
        if not checked and ratios:
            self._check(far, ratios, path)
        if self.repeated:
            self.warnings.append(f"{self.repeated} requests repeat a block id inside the request (the first at line "
                                 f"{first_repeat}): ids not chained, so a hit there is not a prefix and replay's and "
                                 f"plan's figures are a model")

    def _check(self, far: int, ratios: list[float], path: str) -> None:
        if 2 * far <= len(ratios):
            return
        bt, med = implied_block_tokens(ratios)
        field = "block_tokens" if self.declared else f"block_tokens (absent: {BLOCK_TOKENS})"
        raise TraceError(f"{path}: field {field}: {far} of {len(ratios)} requests have an input_length more than "
                         f"{FAR:g}x off len(hash_ids) x {self.block_tokens}; their lengths imply blocks of about "
                         f"{bt} tokens (median {med:.1f} tokens per id): set block_tokens: {bt} on each line, or "
                         f"pass --trust-block-tokens")


def _errno(e: OSError) -> str:
    import errno
    return errno.errorcode.get(e.errno or 0, "EIO")


def load_trace(path: str | os.PathLike, limit: int | None = None, trust_block_tokens: bool = False) -> Trace:
    """Read a Mooncake JSONL trace (plain or .gz) into a `Trace`: its requests, block size,
    geometry (the recorder's header) and the reader's warnings."""
    reader = TraceReader(path, limit, trust_block_tokens)
    reqs = list(reader)
    t = Trace(reqs, reader.block_tokens)
    t.geometry, t.warnings = reader.geometry, reader.warnings
    return t


def unique_blocks(reqs: Iterable[Request]) -> int:
    seen: set[int] = set()
    for r in reqs:
        seen.update(r.hash_ids)
    return len(seen)


def total_blocks(reqs: Iterable[Request]) -> int:
    return sum(len(r.hash_ids) for r in reqs)


def split_by_time(reqs: Sequence[Request], frac: float = 0.5) -> tuple[list[Request], list[Request]]:
    """Split at the timestamp `frac` of the way from the first to the last request.

    Requests at or after the cut go to the second part; order is kept.
    """
    if not reqs:
        return [], []
    if not 0.0 <= frac <= 1.0:
        raise ValueError(f"frac must be in [0, 1], got {frac}")
    t0 = min(r.timestamp for r in reqs)
    t1 = max(r.timestamp for r in reqs)
    cut = t0 + frac * (t1 - t0)
    a = [r for r in reqs if r.timestamp < cut]
    b = [r for r in reqs if r.timestamp >= cut]
    return a, b


def rescale_stack(cfg, block_tokens: int):
    """`cfg` (a StackConfig) in blocks of `block_tokens` tokens: the same bytes per token and
    the same capacities in tokens (capacities given in bytes stay; `capacity_blocks` scale)."""
    from kvtier.core.config import parse_config
    if cfg.block_tokens == block_tokens:
        return cfg
    data = cfg.model_dump(exclude={"source"})
    data["block_bytes"] = max(1, -(-cfg.block_bytes * block_tokens // cfg.block_tokens))
    for t in data["tiers"]:
        if t.get("capacity_blocks") is not None:
            t["capacity_blocks"] = max(1, t["capacity_blocks"] * cfg.block_tokens // block_tokens)
    data["block_tokens"] = block_tokens
    return parse_config(data, source=f"{cfg.source} (in {block_tokens}-token blocks)", check_env=False)


def apply_geometry(cfg, block_tokens: int, geometry: dict | None = None):
    """(`cfg` in the trace's blocks, a line saying so or None). A recorded geometry (the header)
    wins: its block bytes and tokens, capacities in bytes counted in those blocks (as the served
    connector counts them); without one, `rescale_stack` to the trace's block tokens."""
    from kvtier.core.config import parse_config
    from kvtier.common.units import format_size
    bb = (geometry or {}).get("block_bytes")
    if not bb:
        out = rescale_stack(cfg, block_tokens)
        if out is cfg:
            return cfg, None
        return out, (f"the trace's blocks are {block_tokens} tokens, the config's {cfg.block_tokens}: sizing in "
                     f"{block_tokens}-token blocks of {format_size(out.block_bytes)} (the config's bytes per token)")
    if (cfg.block_bytes, cfg.block_tokens) == (bb, block_tokens):
        return cfg, None
    data = cfg.model_dump(exclude={"source"})
    data["block_bytes"], data["block_tokens"] = bb, block_tokens
    served = ", ".join(f"{k} {geometry[k]}" for k in ("model", "kv_dtype") if geometry.get(k))
    out = parse_config(data, source=f"{cfg.source} (in the trace's {block_tokens}-token blocks of {format_size(bb)})",
                       check_env=False)
    return out, (f"using the trace's geometry, as the server stored it ({block_tokens}-token blocks of "
                 f"{format_size(bb)}{', ' + served if served else ''}) over the config's ({cfg.block_tokens}-token "
                 f"blocks of {format_size(cfg.block_bytes)})")


def make_keys(reqs: Sequence[Request]) -> list[list[bytes]]:
    """Per request, its chain of block keys (one bytes object per unique block, shared)."""
    cache: dict[int, bytes] = {}
    out = []
    for r in reqs:
        row = []
        for h in r.hash_ids:
            k = cache.get(h)
            if k is None:
                k = cache[h] = make_key(h)
            row.append(k)
        out.append(row)
    return out
