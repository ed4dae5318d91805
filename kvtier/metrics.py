"""Counters every stack keeps, exportable to Prometheus."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable


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


def export_prometheus(metrics: StackMetrics, tier_names: Iterable[str], registry=None, prefix: str = "kvtier"):
    """Register the counters as Prometheus gauges (current values) in `registry` and return it."""
    from prometheus_client import CollectorRegistry, Gauge

    registry = registry or CollectorRegistry()
    names = list(tier_names)
    for field_name, value in metrics.as_dict().items():
        if isinstance(value, dict):
            g = Gauge(f"{prefix}_{field_name}", f"kvtier {field_name.replace('_', ' ')} per tier", ["tier"],
                      registry=registry)
            for t in names:
                g.labels(tier=t).set(value.get(t, 0))
        else:
            Gauge(f"{prefix}_{field_name}", f"kvtier {field_name.replace('_', ' ')}", registry=registry).set(value)
    return registry
