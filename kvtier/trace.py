"""Mooncake-format request traces: one JSON object per line.

Each line: ``timestamp`` (ms from start, number), ``input_length`` and ``output_length``
(tokens, non-negative ints) and ``hash_ids`` (list of non-negative ints: chained hashes of
``block_tokens``-token blocks; a block id stands for its whole prefix).
"""

from __future__ import annotations

import gzip
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

BLOCK_TOKENS = 512
BUNDLED = "mooncake_conversation.jsonl.gz"  # package data: Mooncake FAST'25 conversation trace (NOTICE)


def bundled_trace() -> Path:
    """The Mooncake conversation trace shipped inside the package (gzipped)."""
    return Path(__file__).resolve().parent / "data" / BUNDLED


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


def load_trace(path: str | os.PathLike, limit: int | None = None) -> list[Request]:
    """Read a Mooncake JSONL trace (plain or .gz); blank lines are skipped; errors name line and field."""
    reqs: list[Request] = []
    opener = gzip.open if os.fspath(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            where = f"{os.fspath(path)}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            reqs.append(parse_request(obj, where))
            if limit is not None and len(reqs) >= limit:
                break
    return reqs


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
