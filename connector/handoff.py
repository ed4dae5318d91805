"""The workers' last NVMe write-back report, handed to the scheduler at shutdown through the tier's
directory.

vLLM shuts the workers down before the scheduler. A worker's pending write-back is durable once
its `close()` returns, but its report (checksums per slot) rides on the output of a step that will
never run, and without it the scheduler does not index those blocks. On the CPU backend the
workers are other processes, so each worker writes its report to
`<nvme dir>/shutdown-report.<rank>.json` (0600, O_NOFOLLOW, written then renamed) and the
scheduler's `shutdown()`, which runs after the workers exited, commits what it finds there before
it closes the index. A scheduler deletes reports left by an earlier run when it starts (their
op ids mean nothing to it).
"""

from __future__ import annotations

import json
import logging
import os
import re

from kvtier.core.serving_stats import write_private

from .metadata import KVTierWorkerMeta

log = logging.getLogger("kvtier.connector")
_NAME = re.compile(r"^shutdown-report\.(\d+)\.json$")


def write_report(nvme_dir: str, meta: KVTierWorkerMeta) -> str:
    """Write this rank's unreported NVMe writes; returns the file's path."""
    return write_private(os.path.join(nvme_dir, f"shutdown-report.{int(meta.rank)}.json"),
                          {"rank": int(meta.rank),
                           "copied": {str(int(op)): [int(c) for c in sums]
                                            for op, sums in meta.copied.items()}}, fsync=True)


def read_reports(nvme_dir: str, remove: bool = True) -> KVTierWorkerMeta | None:
    """Every rank's report found in `nvme_dir`, aggregated (None when there is none)."""
    out: KVTierWorkerMeta | None = None
    try:
        names = sorted(n for n in os.listdir(nvme_dir) if _NAME.match(n))
    except OSError:
        return None
    for n in names:
        p = os.path.join(nvme_dir, n)
        try:
            fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd, "rb") as f:
                d = json.loads(f.read(64 << 20))
            m = KVTierWorkerMeta(rank=int(d["rank"]),
                                 copied={int(op): [int(c) for c in sums]
                                               for op, sums in dict(d["copied"]).items()})
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("kvtier: ignoring shutdown report %s: %s", p, e)
            m = None
        if remove:
            try:
                os.unlink(p)
            except OSError:
                pass
        if m is not None:
            out = m if out is None else out.aggregate(m)
    return out


def clear_reports(nvme_dir: str) -> int:
    """Delete reports an earlier run left (its scheduler never read them); returns how many."""
    n = 0
    try:
        names = [x for x in os.listdir(nvme_dir) if _NAME.match(x) or x.startswith("shutdown-report.")
                 and x.endswith(".json.tmp")]
    except OSError:
        return 0
    for x in names:
        try:
            os.unlink(os.path.join(nvme_dir, x))
            n += 1
        except OSError:
            pass
    return n
