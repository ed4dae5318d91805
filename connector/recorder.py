"""Record the live traffic as a trace for `kvtier plan` / `kvtier replay` (`serving.record_trace`).

One Mooncake-format line per finished request: `timestamp` (ms since recording began),
`input_length`, `output_length`, `hash_ids` and `block_tokens` (kvtier.offline.trace reads it).
The ids are vLLM's chained block hashes of the prompt's full blocks, each turned into a 63-bit
integer by a hash keyed with a secret of this deployment (`record-secret` beside the trace, 0600):
equal prefixes give equal ids, within a deployment and across its restarts, and no id reveals a
token. No token id or text is written.

Off the scheduler's critical path: `record` only appends a tuple to a deque (no lock: safe when a
signal handler calls `close` while the scheduler is inside `record`); one writer thread, woken
every `POLL_S`, formats and writes each line with one `write` of the whole line. Bounded: at most
`QUEUE_MAX` records wait (more are dropped, counted) and the file rotates at `max_bytes` (the
previous one kept as `PATH.1`). `close` (vLLM's shutdown on SIGTERM) writes what waits, within its
timeout: the file ends on a whole line.
"""

from __future__ import annotations

import logging
import os
import collections
import threading
import time
from typing import Any, Callable, Sequence

import xxhash

log = logging.getLogger("kvtier.connector")

QUEUE_MAX = 1 << 16
POLL_S = 0.05
SECRET_BYTES = 32


def _secret(path: str) -> bytes:
    """The deployment's id key, created once next to the trace (0600, never replaced)."""
    p = os.path.join(os.path.dirname(os.path.abspath(path)) or ".", "record-secret")
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        with open(p, "rb") as f:
            key = f.read(SECRET_BYTES + 1)
        if len(key) != SECRET_BYTES:
            raise ValueError(f"record_trace: {p} is not a {SECRET_BYTES}-byte key (remove it to start anew)")
        return key
    key = os.urandom(SECRET_BYTES)
    try:
        os.write(fd, key)
        os.fsync(fd)
    finally:
        os.close(fd)
    return key


class TraceRecorder:
    def __init__(self, path: str, block_tokens: int, max_bytes: int = 256 << 20,
                 count: Callable[..., None] | None = None) -> None:
        self.path = os.path.abspath(path)
        self.block_tokens = block_tokens
        self.max_bytes = max_bytes
        self._count = count or (lambda key, v=1: None)
        self._key = _secret(self.path)
        self._t0 = time.time()
        self._q: collections.deque = collections.deque()
        self._fd = self._open()
        self._closed = False
        self._stop = threading.Event()   # set by `close` only: the writer drains and ends
        self._thread = threading.Thread(target=self._run, name="kvtier-record", daemon=True)
        self._thread.start()
        log.info("kvtier: recording the traffic to %s (block %d tokens, rotated at %d MiB)", self.path,
                 block_tokens, max_bytes >> 20)

    def _open(self) -> int:
        return os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)

    def record(self, arrival_s: float, input_length: int, output_length: int, hashes: Sequence[Any]) -> None:
        """Queue one finished request (vLLM's arrival time in seconds, its prompt's full-block hashes)."""
        if self._closed:
            return
        if len(self._q) >= QUEUE_MAX:
            self._count("record_dropped_requests")
            return
        self._q.append((arrival_s, input_length, output_length, tuple(hashes)))   # bytes() in the writer

    def _id(self, h: bytes) -> int:
        """A 63-bit id of a block hash, keyed with the deployment's secret."""
        return xxhash.xxh3_64_intdigest(self._key + bytes(h)) >> 1

    def _line(self, rec: tuple) -> bytes:
        arrival, n_in, n_out, hashes = rec
        ids = ", ".join(str(self._id(h)) for h in hashes)
        ts = max(0, int((arrival - self._t0) * 1000))
        return (f'{{"timestamp": {ts}, "input_length": {n_in}, "output_length": {n_out}, '
                f'"hash_ids": [{ids}], "block_tokens": {self.block_tokens}}}\n').encode()

    def _run(self) -> None:
        while True:
            stopping = self._stop.is_set()
            while self._q:
                self._write(self._q.popleft())
            if stopping:
                return
            self._stop.wait(POLL_S)

    def _write(self, rec: tuple) -> None:
        try:
            line = self._line(rec)
            if os.fstat(self._fd).st_size + len(line) > self.max_bytes:
                os.close(self._fd)
                os.replace(self.path, self.path + ".1")
                self._fd = self._open()
                self._count("record_rotations")
            os.write(self._fd, line)
            self._count("recorded_requests")
        except OSError as e:  # a full disk: the record is lost, counted, never raised into vLLM
            self._count("record_errors")
            log.debug("kvtier: record_trace: %s", e)

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued (bounded) and close the file."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():   # still writing: what is left is lost, the file ends on a whole line
            log.warning("kvtier: record_trace: %d requests not written within %.0f s of shutdown",
                        len(self._q), timeout_s)
            self._count("record_dropped_requests", len(self._q))
            return
        try:
            os.close(self._fd)
        except OSError:
            pass
