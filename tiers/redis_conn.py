"""The shared tier's connection: settings, client (standalone or Redis Cluster), names, breaker.

- `RedisSettings`: what a `redis` tier's YAML says (url, cluster, credentials, TLS, timeouts).
- `connect`: a redis-py client with our timeouts and no hidden retries (the breaker decides).
- `Namespace`: the server's key names for one fingerprint and rank, and the block codec
  (the NVMe tier's keyed header, sealed with the fleet's secret).
- `Breaker`: a dead or slow server is one warning, a counter per failure, misses meanwhile, and
  reconnection attempts with exponential backoff; one info line when it answers again.

Credentials never reach a log line: `redact(url)` is what is shown.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from .nvme_block import BlockCodec

log = logging.getLogger("kvtier.redis")

KEY_PREFIX = "kvt"


@dataclass(frozen=True)
class RedisSettings:
    url: str = "redis://localhost:6379/0"
    cluster: bool = False
    username: str | None = None
    password: str | None = None
    tls_ca: str | None = None
    timeout_s: float = 1.0
    connect_timeout_s: float = 0.5
    pool_size: int = 16
    batch_bytes: int = 16 << 20
    secret: str | None = None

    @classmethod
    def of(cls, t: Any) -> "RedisSettings":
        """From a `TierConfig` of kind redis."""
        return cls(url=t.url, cluster=t.cluster, username=t.username, password=t.password, tls_ca=t.tls_ca,
                   timeout_s=t.timeout_s, connect_timeout_s=t.connect_timeout_s, pool_size=t.pool_size,
                   batch_bytes=t.batch_bytes, secret=t.secret)

    @property
    def where(self) -> str:
        """The server as logs show it: no credentials."""
        return redact(self.url) + (" (cluster)" if self.cluster else "")

    def __repr__(self) -> str:  # never the password or the secret
        return f"RedisSettings({self.where}, timeout {self.timeout_s}s, pool {self.pool_size})"


def redact(url: str) -> str:
    """`url` without user name and password."""
    u = urlsplit(url)
    if u.username is None and u.password is None:
        return url
    host = u.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = ("***@" if u.username or u.password else "") + host + (f":{u.port}" if u.port else "")
    return urlunsplit((u.scheme, netloc, u.path, u.query, u.fragment))


def connect(s: RedisSettings) -> Any:
    """A redis-py client for `s` (not yet connected: the first command connects)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    kw: dict[str, Any] = {"socket_timeout": s.timeout_s, "socket_connect_timeout": s.connect_timeout_s,
                          "health_check_interval": 0}
    if s.username:
        kw["username"] = s.username
    if s.password:
        kw["password"] = s.password
    if urlsplit(s.url).scheme == "rediss" and s.tls_ca:
        kw["ssl_ca_certs"] = s.tls_ca
    if s.cluster:
        from redis.cluster import RedisCluster
        return RedisCluster.from_url(s.url, max_connections=s.pool_size, retry=Retry(NoBackoff(), 0), **kw)
    return redis.Redis.from_url(s.url, max_connections=s.pool_size, retry=Retry(NoBackoff(), 0), **kw)


def namespace_of(fingerprint: dict) -> str:
    """The key namespace of a fingerprint: a hash of every field but the rank (ranks are in the
    key), so another model, dtype, layout, block size, parallelism or format never shares keys."""
    fp = {k: v for k, v in fingerprint.items() if k != "rank"}
    return hashlib.blake2b(json.dumps(fp, sort_keys=True, default=str).encode(), digest_size=8).hexdigest()


class Namespace:
    """Key names and the value codec of one fingerprint; `rank` is the shard a worker writes."""

    def __init__(self, fingerprint: dict, secret: str | None = None, rank: int = 0) -> None:
        self.ns = namespace_of(fingerprint)
        self.rank = rank
        self.authenticated = bool(secret)
        key = hashlib.blake2b(b"kvtier-shared/" + self.ns.encode() + b"/" + (secret or "").encode(),
                              digest_size=32).digest()
        self.codec = BlockCodec(key, int(self.ns, 16), rank)
        self.prefix = f"{KEY_PREFIX}:{self.ns}:".encode()

    def name(self, key: bytes, rank: int | None = None) -> bytes:
        return self.prefix + str(self.rank if rank is None else rank).encode() + b":" + key.hex().encode()

    def pattern(self) -> bytes:
        """SCAN pattern of every block of this namespace (all ranks; not its manifests)."""
        return self.prefix + b"[0-9]*:*"


class Breaker:
    """Circuit breaker over one server: `allow()` before a command, `ok()` / `fail(e)` after."""

    MIN_S, MAX_S = 0.5, 30.0

    def __init__(self, where: str, count) -> None:
        self.where = where
        self._count = count
        self._lock = threading.Lock()
        self.down = False
        self._backoff = 0.0
        self._retry_at = 0.0

    def allow(self) -> bool:
        if not self.down:
            return True
        with self._lock:
            if time.monotonic() >= self._retry_at:
                self._retry_at = time.monotonic() + self._backoff  # one probe per backoff period
                return True
        return False

    def ok(self) -> None:
        if self.down:
            with self._lock:
                if self.down:
                    self.down = False
                    self._backoff = 0.0
                    log.info("kvtier: shared tier %s answers again", self.where)

    def fail(self, e: BaseException) -> None:
        self._count("unreachable")
        with self._lock:
            first = not self.down
            self.down = True
            self._backoff = min(self.MAX_S, max(self.MIN_S, self._backoff * 2))
            self._retry_at = time.monotonic() + self._backoff
        if first:
            log.warning("kvtier: shared tier %s unreachable (%s: %s): its blocks are misses until it "
                        "answers; retrying with backoff up to %.0f s", self.where, type(e).__name__,
                        _clean(e), self.MAX_S)


def _clean(e: BaseException) -> str:
    """An exception's text, first line, with any URL redacted."""
    s = str(e).splitlines()[0] if str(e) else ""
    return " ".join(redact(w) if "://" in w else w for w in s.split(" "))
