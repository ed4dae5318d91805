"""The serving scheduler's counters, left in its NVMe directory for `kvtier inspect --watch`.

The connector's scheduler writes its totals at most once a second and at shutdown
(`serving-stats.json`, 0600, renamed into place); `kvtier inspect` reads them without the
writer's lock and shows hit ratios per tier. Free of vLLM: the CLI imports it.
"""

from __future__ import annotations

import json
import logging
import os
import time

from kvtier.common.counters import Metric

from .private_files import PrivateDir, pid_alive, read_file

log = logging.getLogger("kvtier.connector")

STATS_FILE = "serving-stats.json"


def write_private(path: str, obj: dict, fsync: bool, parents: bool = False) -> str:
    """`obj` as JSON at `path`, in an existing directory of this user's (`private_files`: 0600,
    a fresh temp file renamed into place; nothing planted there is followed or blocks)."""
    with PrivateDir.open(os.path.dirname(path), create=False, parents=parents) as d:
        return d.write(os.path.basename(path), json.dumps(obj).encode(), fsync=fsync)


_DONE: set[str] = set()   # what this process did once: warned, pruned


def _first(what: str) -> bool:
    """True the first time this process asks for `what`."""
    if what in _DONE:
        return False
    _DONE.add(what)
    return True


def write_stats(nvme_dir: str, totals: dict[str, float]) -> None:
    """The serving scheduler's counters since it started, for `kvtier inspect --watch` (which
    reads the directory without the writer's lock). Best effort: a failure is logged once."""
    try:
        write_private(os.path.join(nvme_dir, STATS_FILE),
                      {"pid": os.getpid(), "time": time.time(), "totals": totals}, fsync=False)
    except OSError as e:
        if _first("stats_warned"):
            log.warning("kvtier: cannot write %s in %s: %s (kvtier inspect shows no hit ratios)",
                        STATS_FILE, nvme_dir, e)


def read_stats(nvme_dir: str) -> dict | None:
    """What `write_stats` left, or None (no serving scheduler wrote it, or it is unreadable)."""
    try:
        d = json.loads(read_file(os.path.join(nvme_dir, STATS_FILE), 1 << 20) or b"null")
        return d if isinstance(d, dict) and isinstance(d.get("totals"), dict) else None
    except (OSError, ValueError):
        return None


def hit_ratios(stats: dict) -> dict:
    """Block hit ratio overall and per tier from written totals (hits / blocks looked up)."""
    t = stats.get("totals", {})
    hits = {k.split(".", 1)[1]: int(v) for k, v in t.items() if k.startswith(Metric.HIT_BLOCKS.at(""))}
    for k in list(hits):  # planned from the shared tier but gone at load: recomputed, not hits
        hits[k] -= int(t.get(Metric.GONE_BLOCKS.at(k), 0))
    asked = sum(hits.values()) + int(t.get(Metric.MISS_BLOCKS.key, 0)) + sum(
        int(v) for k, v in t.items() if k.startswith(Metric.GONE_BLOCKS.at("")))
    out = {"pid": stats.get("pid"), "age_s": round(max(0.0, time.time() - float(stats.get("time", 0))), 1),
           "lookups": int(t.get(Metric.N_LOOKUPS.key, 0)), "blocks_looked_up": asked,
           "hit_ratio": sum(hits.values()) / asked if asked else 0.0}
    out["hit_ratio_by_tier"] = {k: v / asked if asked else 0.0 for k, v in sorted(hits.items())}
    from kvtier.core.tenants import tenant_counters
    ten = tenant_counters(t)
    if ten:   # YAML tenants: per tenant and tier, blocks hit, stored, evicted
        out["tenants"] = ten
    return out


# ---- the server's own state, found without its config (`kvtier inspect --server`) ---------------
STATE_PREFIX = "server-"
HEARTBEAT_S = 1.0      # a serving scheduler rewrites its state this often, idle or not
STALE_S = 10.0         # a state older than this, from a live pid, is a server not answering
KEEP_S = 86400.0       # the state of a server gone for longer is removed (by the next server to start)


def run_dir() -> str:
    """Where serving schedulers leave their state: $KVTIER_RUN_DIR, else $XDG_RUNTIME_DIR/kvtier,
    else /tmp/kvtier-UID (0700, this user's: `private_files`)."""
    d = os.environ.get("KVTIER_RUN_DIR")
    if d:
        return os.path.abspath(os.path.expanduser(d))
    x = os.environ.get("XDG_RUNTIME_DIR")
    return os.path.join(x, "kvtier") if x else f"/tmp/kvtier-{os.getuid()}"


def open_run_dir(create: bool = True) -> PrivateDir:
    """run_dir(), opened by `PrivateDir.open` (UnsafeDir: another user's, writable by others, ...)."""
    return PrivateDir.open(run_dir(), create=create)


def write_server_state(state: dict) -> str | None:
    """This server's state (see `kvtier inspect --server`) as run_dir()/server-PID.json; best
    effort: a directory it cannot use is logged once."""
    try:
        with open_run_dir() as d:
            if _first("pruned"):
                _prune(d)
            return d.write(f"{STATE_PREFIX}{os.getpid()}.json",
                           json.dumps({**state, "pid": os.getpid(), "time": time.time()}).encode())
    except OSError as e:
        if _first("server_warned"):
            log.warning("kvtier: cannot leave the server's state in %s: %s (kvtier inspect --server will not "
                        "find it; set KVTIER_RUN_DIR)", run_dir(), e.strerror or e)
        return None


def _prune(d: PrivateDir) -> None:
    """States of servers gone for more than KEEP_S, and temp files of dead writers: removed (once
    per process; an unlink never follows a symlink nor opens a FIFO)."""
    d.remove_temps(pid_alive)
    for n in d.names():
        stem = n.removesuffix(".tmp")   # server-PID.json.tmp: an earlier version's temp name
        pid = stem[len(STATE_PREFIX):-len(".json")] if n.startswith(STATE_PREFIX) and stem.endswith(".json") else ""
        try:
            if pid.isdigit() and not pid_alive(int(pid)) and time.time() - d.lstat(n).st_mtime > KEEP_S:
                d.unlink(n)
        except OSError:
            pass


def read_servers(pid: int | None = None) -> list[dict]:
    """The states servers left in run_dir() (newest first), each with `status`: "serving", "not
    answering" (a live pid, no state for STALE_S) or "not running" (exited or shut down), and
    `age_s` (seconds since it last wrote). A run directory kvtier may not use holds none."""
    try:
        d = open_run_dir(create=False)
    except OSError:
        return []
    with d:
        names = sorted(n for n in d.names() if n.startswith(STATE_PREFIX) and n.endswith(".json"))
        out = []
        for n in names:
            if pid is not None and n != f"{STATE_PREFIX}{pid}.json":
                continue
            try:
                s = json.loads(d.read(n, 1 << 22) or b"null")
            except (OSError, ValueError):
                continue
            if not isinstance(s, dict) or not isinstance(s.get("pid"), int):
                continue
            age = max(0.0, time.time() - float(s.get("time", 0)))
            if s.get("stopped") or not pid_alive(s["pid"]):
                s["status"] = "not running"
            else:
                s["status"] = "serving" if age <= STALE_S else "not answering"
            s["age_s"] = round(age, 1)
            s["file"] = d.join(n)
            out.append(s)
    return sorted(out, key=lambda s: -float(s.get("time", 0)))
