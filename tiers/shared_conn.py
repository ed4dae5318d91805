"""The shared tier's connection: settings, client (standalone or Redis Cluster), names, breaker.

- `RedisSettings`: what a `redis` tier's YAML says (url, cluster, credentials, TLS, timeouts).
- `connect`: a redis-py client with our timeouts and no hidden retries (the breaker decides).
- `Namespace`: the server's key names for one fingerprint and rank, and the block codec
  (the NVMe tier's keyed header, sealed with the fleet's secret).
- `Breaker`: a dead or slow server is one warning, a counter per failure, misses meanwhile, and
  reconnection attempts with exponential backoff; one info line when it answers again.

Credentials never reach a log line: `where` (the URL through `redact.redact`) is what is shown,
and `RedisSettings` prints no URL, password or secret (its repr and str are `where`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from .nvme_block import BlockCodec
from kvtier.common.counters import Metric
from .redact import redact

log = logging.getLogger("kvtier.shared")

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

    __str__ = __repr__


class Parts(tuple):
    """A value sent as the concatenation of its parts (e.g. a block's header, then a memoryview
    of its payload): `ZeroCopyPacker` writes each part straight to the socket, so the payload is
    never copied on its way out. Only a client from `connect` with `zero_copy` set can send one."""

    @property
    def nbytes(self) -> int:
        return sum(len(p) for p in self)

    def tobytes(self) -> bytes:
        return b"".join(bytes(p) for p in self)


def _packer_class():
    from redis.connection import PythonRespSerializer

    class ZeroCopyPacker(PythonRespSerializer):
        """redis-py's pure-Python RESP packer, plus `Parts` values. Values over the cutoff and
        memoryviews go to `sendall` as they are (zero copies); hiredis' packer (redis-py's default
        when hiredis is installed) copies every value into one buffer, and a bytearray or
        memoryview twice (bytes() first). Replies are still parsed by hiredis."""

        def pack(self, *args):
            if not any(type(a) is Parts for a in args):
                return super().pack(*args)
            if isinstance(args[0], str):
                args = tuple(args[0].encode().split()) + args[1:]
            out: list = []
            buff = b"*%d\r\n" % len(args)
            for a in args:
                if type(a) is Parts:
                    buff += b"$%d\r\n" % a.nbytes
                    for part in a:
                        if len(part) > self._buffer_cutoff or isinstance(part, memoryview):
                            out.append(buff)
                            out.append(part)
                            buff = b""
                        else:
                            buff += part
                    buff += b"\r\n"
                else:
                    a = self.encode(a)
                    buff += b"$%d\r\n" % len(a) + bytes(a) + b"\r\n"
            out.append(buff)
            return out
    return ZeroCopyPacker


_CONN_CLASSES: dict = {}


def _connection_class(scheme: str):
    """A redis-py Connection (SSLConnection for rediss://, UnixDomainSocketConnection for unix://)
    class whose packer is `ZeroCopyPacker`: the way to give RedisCluster's node connections our
    packer (it drops a `command_packer` argument)."""
    if scheme not in _CONN_CLASSES:
        from redis.connection import Connection, SSLConnection, UnixDomainSocketConnection
        packer = _packer_class()
        base = {"rediss": SSLConnection, "unix": UnixDomainSocketConnection}.get(scheme, Connection)

        class ZeroCopyConnection(base):  # type: ignore[valid-type, misc]
            def __init__(self, *a, **kw):
                kw.pop("command_packer", None)
                super().__init__(*a, **kw)
                self._command_packer = packer(self._buffer_cutoff, self.encoder.encode)

        ZeroCopyConnection.__name__ = "ZeroCopy" + base.__name__
        _CONN_CLASSES[scheme] = ZeroCopyConnection
    return _CONN_CLASSES[scheme]


def connect(s: RedisSettings, plain: bool = False) -> Any:
    """A redis-py client for `s` (not yet connected: the first command connects).

    Its connections pack commands with `ZeroCopyPacker` (`client.kvtier_zero_copy` is True): a
    `Parts` value goes out with no copy of its payload. Not for a TLS cluster (`rediss://` with
    `cluster: true`): redis-py then picks its own SSLConnection class for the nodes, so
    `kvtier_zero_copy` is False and the data plane sends one joined buffer instead. `plain`:
    redis-py's own connection class and packer (what `kvtier bench` compares with)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    kw: dict[str, Any] = {"socket_timeout": s.timeout_s, "socket_connect_timeout": s.connect_timeout_s,
                          "health_check_interval": 0}
    if s.username:
        kw["username"] = s.username
    if s.password:
        kw["password"] = s.password
    scheme = urlsplit(s.url).scheme
    tls = scheme == "rediss"
    if tls and s.tls_ca:
        kw["ssl_ca_certs"] = s.tls_ca
    if s.cluster:
        from redis.cluster import RedisCluster
        if not tls and not plain:  # a rediss:// URL makes RedisCluster override connection_class with its own
            kw["connection_class"] = _connection_class("redis")
        client = RedisCluster.from_url(s.url, max_connections=s.pool_size, retry=Retry(NoBackoff(), 0), **kw)
    else:
        if not plain:
            kw["connection_class"] = _connection_class(scheme)  # from_url keeps an explicit connection_class
        client = redis.Redis.from_url(s.url, max_connections=s.pool_size, retry=Retry(NoBackoff(), 0), **kw)
    client.kvtier_zero_copy = not plain and not (s.cluster and tls)
    return client


def namespace_of(fingerprint: dict) -> str:
    """The key namespace of a fingerprint: a hash of every field but the rank (ranks are in the
    key), so another model, dtype, layout, block size, parallelism or format never shares keys."""
    fp = {k: v for k, v in fingerprint.items() if k != "rank"}
    return hashlib.blake2b(json.dumps(fp, sort_keys=True, default=str).encode(), digest_size=8).hexdigest()


class Namespace:
    """Key names and the value codec of one fingerprint; `rank` is the shard a worker writes."""

    def __init__(self, fingerprint: dict, secret: str | None = None, rank: int = 0, sealer=None) -> None:
        self.ns = namespace_of(fingerprint)
        self.rank = rank
        self.authenticated = bool(secret)
        key = hashlib.blake2b(b"kvtier-shared/" + self.ns.encode() + b"/" + (secret or "").encode(),
                              digest_size=32).digest()
        self.codec = BlockCodec(key, int(self.ns, 16), rank, sealer)  # sealer: values encrypted (`sealing`)
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
        self._count(Metric.UNREACHABLE)
        with self._lock:
            first = not self.down
            self.down = True
            self._backoff = min(self.MAX_S, max(self.MIN_S, self._backoff * 2))
            self._retry_at = time.monotonic() + self._backoff
        if first:
            log.warning("kvtier: shared tier %s unreachable (%s: %s): its blocks are misses until it "
                        "answers; retrying with backoff up to %.0f s", self.where, type(e).__name__,
                        error_text(e), self.MAX_S)


def error_text(e: BaseException) -> str:
    """An exception's text, first line, with every password in it redacted (`redact`)."""
    return redact(str(e).splitlines()[0] if str(e) else "")
