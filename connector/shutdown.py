"""vLLM's shutdown of the connector (SIGTERM / SIGINT of the server, LLM deleted).

The executor's workers shut down first, then the scheduler. A worker waits (bounded) for its
pending NVMe write-back and hands the report no step carried to the scheduler: directly when it
lives in this process, else through the NVMe directory (connector/handoff.py). The scheduler
commits it, then closes the index and its directory lock.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from .handoff import read_reports, write_report
from .startup import flush_budget_s, short_totals
from .worker import SHUTDOWN_FLUSH_TIMEOUT_S

log = logging.getLogger("kvtier.connector")


def close_worker(worker: Any, schedulers: list[Any]) -> None:
    """Close `worker`; its last write-back report to the first of `schedulers` (this process's),
    else into its NVMe directory."""
    nvme_dir = worker.nvme.dir if worker.nvme is not None else None
    final = worker.close(timeout_s=flush_budget_s(SHUTDOWN_FLUSH_TIMEOUT_S))
    if final is None or not final.copied:
        return
    n = sum(1 for v in final.copied.values() for c in v if c != -1)
    if schedulers:
        schedulers[0].on_worker_meta(final)
        log.info("kvtier: shutdown: %d NVMe blocks written back after the last step, handed "
                 "to the scheduler", n)
    elif nvme_dir:
        path = write_report(nvme_dir, final)
        log.info("kvtier: shutdown: %d NVMe blocks written back after the last step; report "
                 "for the scheduler in %s", n, path)
    else:
        log.warning("kvtier: shutdown: %d NVMe blocks written back after the last step and no "
                    "way to tell the scheduler: not indexed (misses after a restart)", n)


def close_scheduler(sched: Any, stats: Any) -> None:
    """Commit the workers' last reports, write the final state (`stats`, a `SchedulerStats`),
    close the trace, the NVMe index and its directory lock."""
    for t in sched.nvme_tiers():  # the workers exited first: their last reports
        rep = read_reports(t.dir)
        if rep is not None:
            sched.on_worker_meta(rep)
            n = sum(1 for v in rep.written_by_rank().values() for c in next(iter(v.values()), []) if c != -1)
            log.info("kvtier: shutdown: workers' last write-back report read from %s: %d blocks", t.dir, n)
    sched.report_shutdown()
    stats.publish(force=True, final=True)
    t0 = time.monotonic()
    sched.close()  # the trace, the NVMe index and its directory lock
    log.info("kvtier connector (scheduler): shut down, index closed in %.2f s; totals %s",
             time.monotonic() - t0, short_totals(sched.totals))
