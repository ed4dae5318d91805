"""Record the live traffic as a trace for `kvtier plan` / `kvtier replay` (`serving.record_trace`).

One Mooncake-format line per finished request: `timestamp` (ms on a monotonic clock that a restart
continues from the file's last line), `input_length`, `output_length`, `hash_ids` and `block_tokens`
(kvtier.offline.trace reads it); each session, and each new file, starts with a header line
`{"kvtier_trace": {...}}`: the geometry the server stores its blocks in (block tokens and bytes,
model, KV dtype), which `kvtier plan` and `kvtier replay` use over a YAML's.
The ids are vLLM's chained block hashes of the prompt's full blocks, each turned into a 63-bit
integer by a hash keyed with a secret of this deployment (`record-secret` beside the trace, 0600):
equal prefixes give equal ids, within a deployment and across its restarts, and no id reveals a
token. No token id or text is written.

Off the scheduler's critical path: `record` only appends a tuple to a deque (no lock: safe when a
signal handler calls `close` while the scheduler is inside `record`); one writer thread, woken
every `POLL_S`, formats and writes each line with one `write` of the whole line. Bounded: at most
`QUEUE_MAX` records wait (more are dropped, counted) and the file rotates at `max_bytes` (the
previous one kept as `PATH.1`). `close` (vLLM's shutdown on SIGTERM) writes what waits, within its
timeout: the file ends on a whole line. A write cut short (a full file system) is cut back off the
file: never a partial line. A trace renamed or removed from outside is reopened at its path (one
WARNING). A path that cannot be recorded to (its directory cannot be made, read-only, /proc) is one
WARNING at start, and the server serves on without recording.
"""

from __future__ import annotations

import collections
import errno
import json
import logging
import os
import threading
import time
from typing import Any, Callable, Sequence

import xxhash

from kvtier.core.private_files import open_regular, read_file
from kvtier.tiers.nvme_block import make_private_dirs
from kvtier.common.counters import Metric

log = logging.getLogger("kvtier.connector")

QUEUE_MAX = 1 << 16
POLL_S = 0.05
SECRET_BYTES = 32
GEOMETRY_KEY = "kvtier_trace"   # the header line kvtier.offline.trace reads (its GEOMETRY_KEY)
TAIL_BYTES = 1 << 16
MIN_PREFILL_TOKENS = 256   # the prefill speed is stated once this many tokens were timed   # read back at start: the last timestamp, so a restart's clock continues


def _secret(path: str) -> bytes:
    """The deployment's id key, created once next to the trace (0600, never replaced; an existing
    one is read only when a regular file of this user: never through a symlink, never a FIFO)."""
    p = os.path.join(os.path.dirname(os.path.abspath(path)) or ".", "record-secret")
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        key = read_file(p, SECRET_BYTES + 1)
        if key is None or len(key) != SECRET_BYTES:
            raise ValueError(f"record_trace: {p} is not a {SECRET_BYTES}-byte key (remove it to start anew)")
        return key
    key = os.urandom(SECRET_BYTES)
    try:
        os.write(fd, key)
        os.fsync(fd)
    finally:
        os.close(fd)
    return key


def _last_timestamp(path: str) -> float | None:
    """The latest request timestamp (ms) in the trace at `path` or its rotated copy, or None (a
    FIFO, a symlink or another user's file there is not read)."""
    for p in (path, path + ".1"):
        try:
            fd = open_regular(p, os.O_RDONLY)
        except OSError:
            continue
        with os.fdopen(fd, "rb") as f:
            f.seek(max(0, os.fstat(fd).st_size - TAIL_BYTES))
            tail = f.read()
        seen = []
        for line in tail.splitlines():   # lines go in finish order: the latest arrival is the max
            try:
                ts = json.loads(line).get("timestamp")
            except (ValueError, AttributeError):
                continue
            if isinstance(ts, (int, float)) and not isinstance(ts, bool):
                seen.append(float(ts))
        if seen:
            return max(seen)
    return None


def served_geometry(fingerprint: dict, block_bytes: int) -> dict:
    """The header's geometry from the connector's fingerprint: how the server stores its blocks."""
    kv = fingerprint.get("kv_cache_dtype")
    return {"block_bytes": block_bytes, "model": fingerprint.get("model"), "dtype": fingerprint.get("dtype"),
            "kv_dtype": fingerprint.get("dtype") if kv in (None, "auto") else kv}


class TraceRecorder:
    """See the module. `geometry`: how the server stores its blocks (block_tokens, block_bytes,
    model, kv_dtype), written in a header line at each session and each new file. A path it cannot
    record to (its directory cannot be made, the key or the file cannot be opened) is logged once
    and nothing is recorded (`active` False): never an error at start."""

    def __init__(self, path: str, block_tokens: int, max_bytes: int = 256 << 20,
                 count: Callable[..., None] | None = None, geometry: dict | None = None) -> None:
        self.path = os.path.abspath(os.path.expanduser(path))
        self.block_tokens = block_tokens
        self.max_bytes = max_bytes
        self._count = count or (lambda key, v=1: None)
        self.geometry = {"block_tokens": block_tokens, **(geometry or {})}
        self._q: collections.deque = collections.deque()
        self._closed = False
        self._stop = threading.Event()   # set by `close` only: the writer drains and ends
        self._fd = -1
        self._warned = False
        self._step: tuple[float, int] | None = None
        self._prefill = [0, 0.0, 0]        # tokens, seconds, steps timed
        self.active = False
        try:
            make_private_dirs(os.path.dirname(self.path))   # each missing one 0700
            self._key = _secret(self.path)
            last = _last_timestamp(self.path)
            self._fd = self._open()
        except (OSError, ValueError) as e:
            why = f"{e.strerror} [{errno.errorcode.get(e.errno, e.errno)}]" if isinstance(e, OSError) else str(e)
            log.warning("kvtier: serving.record_trace %r: cannot record there (%s); serving without recording",
                        path, why)
            self._closed = True
            return
        self.active = True
        self._m0 = time.monotonic()
        self._base_ms = 0.0 if last is None else last + 1   # a restart continues the last session's clock
        self._thread = threading.Thread(target=self._run, name="kvtier-record", daemon=True)
        self._thread.start()
        log.info("kvtier: recording the traffic to %s (block %d tokens, rotated at %d MiB)", self.path,
                 block_tokens, max_bytes >> 20)

    def _open(self) -> int:
        """Open (create) the trace at its path; a header line starts each session and each new file."""
        fd = open_regular(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)   # a FIFO there: refused, never waited on
        try:
            self._append(fd, self._header())
        except OSError:
            os.close(fd)
            raise
        return fd

    def _header(self) -> bytes:
        g = {"version": 1, **self.geometry}
        tps = self.prefill_tokens_per_s
        if tps is not None:
            g["prefill_tokens_per_s"], g["prefill_steps"] = round(tps, 1), self._prefill[2]
        return (json.dumps({GEOMETRY_KEY: g}) + "\n").encode()

    # ---- the prefill speed, measured (plan's cost model) -----------------------------------
    def step(self, new_tokens: int, all_tokens: int) -> None:
        """A scheduler step begins; it is timed when it only prefills new requests."""
        self._step = (time.perf_counter(), new_tokens) if 0 < new_tokens == all_tokens else None

    def scheduled(self, so: Any) -> None:
        """vLLM's SchedulerOutput of the step that begins: `step` with its new requests' tokens."""
        nst = so.num_scheduled_tokens
        self.step(sum(nst.get(r.req_id, 0) for r in so.scheduled_new_reqs), int(so.total_num_scheduled_tokens))

    def step_done(self) -> None:
        """The step's output came back (its forward ran): a timed step adds to the prefill speed."""
        s, self._step = self._step, None
        if s is not None:
            p = self._prefill
            p[0], p[1], p[2] = p[0] + s[1], p[1] + time.perf_counter() - s[0], p[2] + 1

    @property
    def prefill_tokens_per_s(self) -> float | None:
        """Tokens per second over the steps that only prefilled new requests (None before any)."""
        tokens, secs, _ = self._prefill
        return tokens / secs if secs > 0 and tokens >= MIN_PREFILL_TOKENS else None

    @staticmethod
    def _append(fd: int, line: bytes) -> None:
        """One whole line or nothing: a short write (a full file system) is cut back off."""
        size = os.fstat(fd).st_size
        try:
            n = os.write(fd, line)
        except OSError:
            n = -1
            raise
        finally:
            if n != len(line) and os.fstat(fd).st_size > size:
                os.ftruncate(fd, size)
        if n != len(line):
            raise OSError(errno.ENOSPC, f"short write ({n} of {len(line)} bytes), cut back")

    def record(self, arrival_s: float, input_length: int, output_length: int, hashes: Sequence[Any],
               tenant: str | None = None) -> None:
        """Queue one finished request (vLLM's arrival time in seconds, its prompt's full-block hashes,
        its tenant's label: a tenant YAML `tenants:` names, or `other`)."""
        if self._closed:
            return
        if len(self._q) >= QUEUE_MAX:
            self._count(Metric.RECORD_DROPPED_REQUESTS.key)
            return
        # vLLM's arrival is wall-clock time: only its age is taken, onto the monotonic clock
        at = time.monotonic() - (time.time() - arrival_s)
        self._q.append((at, input_length, output_length, tuple(hashes), tenant))   # bytes() in the writer

    def _id(self, h: bytes) -> int:
        """A 63-bit id of a block hash, keyed with the deployment's secret."""
        return xxhash.xxh3_64_intdigest(self._key + bytes(h)) >> 1

    def _line(self, rec: tuple) -> bytes:
        arrival, n_in, n_out, hashes, tenant = rec
        ids = ", ".join(str(self._id(h)) for h in hashes)
        ts = int(self._base_ms + max(0.0, (arrival - self._m0) * 1000))
        ten = "" if tenant is None else f', "tenant": {json.dumps(tenant)}'
        return (f'{{"timestamp": {ts}, "input_length": {n_in}, "output_length": {n_out}, '
                f'"hash_ids": [{ids}], "block_tokens": {self.block_tokens}{ten}}}\n').encode()

    def _run(self) -> None:
        while True:
            stopping = self._stop.is_set()
            while self._q:
                self._write(self._q.popleft())
            if stopping:
                return
            self._stop.wait(POLL_S)

    def _moved(self) -> bool:
        """Whether the file at the path is no longer the one open (renamed or removed from outside)."""
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return True
        fs = os.fstat(self._fd)
        return (st.st_ino, st.st_dev) != (fs.st_ino, fs.st_dev)

    def _write(self, rec: tuple) -> None:
        try:
            line = self._line(rec)
            if self._fd < 0 or self._moved():
                was = self._fd >= 0
                if was:
                    os.close(self._fd)
                    self._fd = -1
                    log.warning("kvtier: record_trace: %s was renamed or removed; recording anew at that path",
                                self.path)
                self._fd = self._open()
                self._count(Metric.RECORD_REOPENS.key)
            if os.fstat(self._fd).st_size + len(line) > self.max_bytes:
                os.close(self._fd)
                self._fd = -1
                os.replace(self.path, self.path + ".1")
                self._fd = self._open()
                self._count(Metric.RECORD_ROTATIONS.key)
            self._append(self._fd, line)
            self._count(Metric.RECORDED_REQUESTS.key)
        except OSError as e:  # a full disk: the record is lost (no partial line), counted, never raised into vLLM
            self._count(Metric.RECORD_ERRORS.key)
            if not self._warned:
                self._warned = True
                log.warning("kvtier: record_trace: %s: %s; requests not recorded are counted (record_errors)",
                            self.path, e)

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
            self._count(Metric.RECORD_DROPPED_REQUESTS.key, len(self._q))
            return
        try:
            if self._fd >= 0:
                if self.prefill_tokens_per_s is not None:   # the session's measured prefill speed
                    self._append(self._fd, self._header())
                os.close(self._fd)
        except OSError:
            pass
