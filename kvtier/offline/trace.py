"""Mooncake-format request traces: one JSON object per line.

Each line: ``timestamp`` (ms from start, number), ``input_length`` and ``output_length``
(tokens, non-negative ints) and ``hash_ids`` (list of non-negative ints: chained hashes of
``block_tokens``-token blocks; a block id stands for its whole prefix). An optional
``block_tokens`` key (a positive int) gives the block size; absent, it is 512 (the Mooncake
default). Every line of one trace has the same block size: all lines give the same value, or
none gives it.
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
    return Request(float(ts), inp, out, tuple(h))


class Trace(list):
    """The requests of one trace (a list) and the block size of its hash ids."""

    def __init__(self, reqs: Iterable[Request] = (), block_tokens: int = BLOCK_TOKENS) -> None:
        super().__init__(reqs)
        self.block_tokens = block_tokens


def _block_tokens(obj: dict, where: str) -> int | None:
    if "block_tokens" not in obj:
        return None
    v = obj["block_tokens"]
    if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= MAX_BLOCK_TOKENS:
        raise TraceError(f"{where}: field 'block_tokens' must be an integer in [1, {MAX_BLOCK_TOKENS}], got {v!r}")
    return v


class TraceReader:
    """Stream a Mooncake JSONL trace (plain or .gz) request by request, in file order; blank lines
    are skipped; errors name line and field. `block_tokens` is the trace's block size once the
    first request is read (BLOCK_TOKENS when the trace gives none); a line whose block size
    differs from the first line's is an error naming both lines."""

    def __init__(self, path: str | os.PathLike, limit: int | None = None) -> None:
        self.path = path
        self.limit = limit
        self.block_tokens = BLOCK_TOKENS

    def __iter__(self) -> Iterator[Request]:
        path = os.fspath(self.path)
        opener = gzip.open if path.endswith(".gz") else open
        first: tuple[int, int | None] | None = None   # (line, declared block_tokens) of the first request
        n = 0
        if self.limit is not None and self.limit <= 0:
            return
        with opener(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                where = f"{path}:{lineno}"
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise TraceError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
                req = parse_request(obj, where)
                bt = _block_tokens(obj, where)
                if first is None:
                    first = (lineno, bt)
                    self.block_tokens = bt or BLOCK_TOKENS
                elif bt != first[1]:
                    def say(v: int | None) -> str:
                        return f"block_tokens {v}" if v is not None else f"no block_tokens ({BLOCK_TOKENS})"
                    raise TraceError(f"{where}: {say(bt)}, but line {first[0]} has {say(first[1])}: every line of "
                                     f"a trace has the same block size")
                yield req
                n += 1
                if self.limit is not None and n >= self.limit:
                    return


def load_trace(path: str | os.PathLike, limit: int | None = None) -> Trace:
    """Read a Mooncake JSONL trace (plain or .gz) into a `Trace`: its requests and block size."""
    reader = TraceReader(path, limit)
    reqs = list(reader)
    return Trace(reqs, reader.block_tokens)


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
