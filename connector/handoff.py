"""The workers' last NVMe write-back report, handed to the scheduler at shutdown through the tier's
directory.

vLLM shuts the workers down before the scheduler. A worker's pending write-back is durable once
its `close()` returns, but its report (checksums per slot) rides on the output of a step that will
never run, and without it the scheduler does not index those blocks. On the CPU backend the
workers are other processes, so each worker writes its report to
`<nvme dir>/shutdown-report.<rank>.json` (0600, written then renamed: `private_files`) and the
scheduler's `shutdown()`, which runs after the workers exited, commits what it finds there before
it closes the index. A scheduler deletes reports left by an earlier run when it starts (their
op ids mean nothing to it).
"""

from __future__ import annotations

import json
import logging
import os
import re

from kvtier.core.private_files import PrivateDir
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
        d = PrivateDir.open(nvme_dir, create=False, parents=False)
    except OSError:
        return None
    with d:
        for n in sorted(n for n in d.names() if _NAME.match(n)):
            try:   # a FIFO, a symlink or another user's file is refused without blocking
                raw = d.read(n, 64 << 20)
                if raw is None:
                    continue
                doc = json.loads(raw)
                m = KVTierWorkerMeta(rank=int(doc["rank"]),
                                     copied={int(op): [int(c) for c in sums]
                                             for op, sums in dict(doc["copied"]).items()})
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.warning("kvtier: ignoring shutdown report %s: %s", d.join(n), e)
                m = None
            if remove:
                d.unlink(n)
            if m is not None:
                out = m if out is None else out.aggregate(m)
    return out


def clear_reports(nvme_dir: str) -> int:
    """Delete reports an earlier run left (its scheduler never read them) and the temp files of
    their writers; returns how many."""
    try:
        d = PrivateDir.open(nvme_dir, create=False, parents=False)
    except OSError:
        return 0
    with d:
        n = sum(d.unlink(x) for x in d.names() if _NAME.match(x) or x.startswith("shutdown-report.")
                and x.endswith(".json.tmp"))
        return n + sum(d.unlink(x) for x in d.names() if x.startswith(".shutdown-report.") and x.endswith(".tmp"))
