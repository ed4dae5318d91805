"""Counters every stack keeps (offline use: CLI, replay).

Inside vLLM the connector exports its counters to Prometheus in vLLM's convention
(`kvtier.connector.metrics`: `vllm:kvtier_*` series on the server's /metrics).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class StackMetrics:
    """Per-tier counters keyed by tier name; totals are derived."""

    lookups: int = 0
    lookup_blocks: int = 0
    hits: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    misses: int = 0
    stored: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    not_admitted: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    dropped_full: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    evicted: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    demoted: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    promoted: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    corrupt: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes_read: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes_written: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def as_dict(self) -> dict:
        out = {}
        for k, v in self.__dict__.items():
            out[k] = dict(v) if isinstance(v, dict) else v
        return out
