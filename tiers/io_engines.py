"""The NVMe tier's block I/O engines: `select_engine` picks one and says why.

The engines live in modules of their own: the interface and what they share in `io_engine` (the
handles and the fault / crash test hooks too), POSIX O_DIRECT in `io_posix`, kvikio (GDS) in
`io_kvikio`. Their public names are importable from here too. Which engine runs, and any
fallback (e.g. O_DIRECT refused -> buffered), is logged on ``kvtier.nvme`` and reported in
`description` / `stats()`, never silent.
"""

from __future__ import annotations

import logging

from .io_engine import ALIGN, HEADER, MAX_IO_BYTES, EngineFile, EngineUnavailable, IOEngine, round_up
from .io_engine import HOOKS, crash_point
from .io_kvikio import KvikioEngine, cuda_driver_reason
from .io_posix import PosixEngine

__all__ = ["ALIGN", "AUTO_HOST_REASON", "BUFFERS", "HEADER", "HOOKS", "KVIKIO_HOST_NOTE", "MAX_IO_BYTES",
           "EngineFile", "EngineUnavailable", "IOEngine", "KvikioEngine", "PosixEngine", "crash_point",
           "cuda_driver_reason", "round_up", "select_engine"]

log = logging.getLogger("kvtier.nvme")

BUFFERS = ("host", "device")
AUTO_HOST_REASON = ("io=auto: NVMe I/O moves host buffers (CPU pool, staging rows), which kvikio would "
                    "only move with buffered POSIX calls, no GDS; using POSIX")
KVIKIO_HOST_NOTE = ("device staging reads (loads without a DRAM slot) go file -> GPU; DRAM slots and "
                    "host buffers: kvikio's buffered POSIX path")


def select_engine(io: str = "auto", threads: int = 4, direct: bool | str = "auto",
                  max_io_bytes: int = MAX_IO_BYTES, buffers: str = "host") -> tuple[IOEngine, str]:
    """Pick the I/O engine for transfers from/to `buffers` ('host' memory or CUDA 'device' memory).

    'posix': POSIX. 'kvikio': kvikio (EngineUnavailable where it cannot run; with host buffers it
    works but is kvikio's buffered POSIX path, said in the reason). 'auto': POSIX for host buffers
    (what the NVMe tier always moves); for device buffers kvikio when a CUDA driver and kvikio are
    present, else POSIX. Returns (engine, reason); the choice is logged.
    """
    if io not in ("auto", "posix", "kvikio"):
        raise ValueError(f"io must be 'auto', 'posix' or 'kvikio', got {io!r}")
    if buffers not in BUFFERS:
        raise ValueError(f"buffers must be one of {BUFFERS}, got {buffers!r}")
    if io == "kvikio" or (io == "auto" and buffers == "device"):
        try:
            eng = KvikioEngine(threads)
            reason = f"io={io}: CUDA driver present and kvikio imports; mode {eng.mode}"
            if buffers == "host":
                reason += f"; {KVIKIO_HOST_NOTE}"
            log.info("nvme io engine: %s (%s)", eng.description, reason)
            return eng, reason
        except EngineUnavailable as e:
            if io == "kvikio":
                raise
            reason = f"io=auto: {e}; using POSIX"
    elif io == "auto":
        reason = AUTO_HOST_REASON
    else:
        reason = "io=posix asked"
    eng = PosixEngine(threads, direct, max_io_bytes)
    log.info("nvme io engine: %s (%s)", eng.description, reason)
    return eng, reason
