"""The serving scheduler's counters, left in its NVMe directory for `kvtier inspect --watch`.

The connector's scheduler writes its totals at most once a second and at shutdown
(`serving-stats.json`, 0600, renamed into place); `kvtier inspect` reads them without the
writer's lock and shows hit ratios per tier. Free of vLLM: the CLI imports it.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import time

log = logging.getLogger("kvtier.connector")

STATS_FILE = "serving-stats.json"


def write_private(path: str, obj: dict, fsync: bool) -> str:
    """`obj` as JSON at `path` (0600, O_NOFOLLOW, written then renamed into place)."""
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, json.dumps(obj).encode())
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


def write_stats(nvme_dir: str, totals: dict[str, float]) -> None:
    """The serving scheduler's counters since it started, for `kvtier inspect --watch` (which
    reads the directory without the writer's lock). Best effort: a failure is logged once."""
    try:
        write_private(os.path.join(nvme_dir, STATS_FILE),
                      {"pid": os.getpid(), "time": time.time(), "totals": totals}, fsync=False)
    except OSError as e:
        if not getattr(write_stats, "_warned", False):
            write_stats._warned = True  # type: ignore[attr-defined]
            log.warning("kvtier: cannot write %s in %s: %s (kvtier inspect shows no hit ratios)",
                        STATS_FILE, nvme_dir, e)


def read_stats(nvme_dir: str) -> dict | None:
    """What `write_stats` left, or None (no serving scheduler wrote it, or it is unreadable)."""
    try:
        fd = os.open(os.path.join(nvme_dir, STATS_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            d = json.loads(f.read(1 << 20))
        return d if isinstance(d, dict) and isinstance(d.get("totals"), dict) else None
    except (OSError, ValueError):
        return None


def hit_ratios(stats: dict) -> dict:
    """Block hit ratio overall and per tier from written totals (hits / blocks looked up)."""
    t = stats.get("totals", {})
    hits = {k.split(".", 1)[1]: int(v) for k, v in t.items() if k.startswith("hit_blocks.")}
    for k in list(hits):  # planned from the shared tier but gone at load: recomputed, not hits
        hits[k] -= int(t.get(f"gone_blocks.{k}", 0))
    asked = sum(hits.values()) + int(t.get("miss_blocks", 0)) + sum(
        int(v) for k, v in t.items() if k.startswith("gone_blocks."))
    out = {"pid": stats.get("pid"), "age_s": round(max(0.0, time.time() - float(stats.get("time", 0))), 1),
           "lookups": int(t.get("n_lookups", 0)), "blocks_looked_up": asked,
           "hit_ratio": sum(hits.values()) / asked if asked else 0.0}
    out["hit_ratio_by_tier"] = {k: v / asked if asked else 0.0 for k, v in sorted(hits.items())}
    return out
