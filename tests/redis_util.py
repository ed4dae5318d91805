"""Real `redis-server` processes for the tests: standalone (plain, password, ACL user, TLS, maxmemory)
and a 3-node Redis Cluster, on free loopback ports, each with its files in a private 0700 temp dir.

Every process is registered until closed; atexit closes the rest, and on Linux each server gets
PDEATHSIG=SIGKILL, so none outlives the test process even if it is killed (start servers from the
main thread: PDEATHSIG fires when the starting *thread* exits).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

import redis
import redis.cluster

SETUP_HINT = "run scripts/setup test (installs the Debian package redis-server)"
READY_TIMEOUT_S = 30.0
CLUSTER_TIMEOUT_S = 60.0
_SAFE = re.compile(r"[A-Za-z0-9_.\-]+")  # passwords / user names written unquoted into the config


class HarnessError(RuntimeError):
    """A server that would not start: the first line says why, the rest is the log's tail."""


def _which(*names: str) -> str | None:
    for n in names:
        p = shutil.which(n)
        if p:
            return p
    return None


def server_binary() -> str:
    p = _which("redis-server", "valkey-server")
    if p is None:
        raise HarnessError(f"redis-server not found: {SETUP_HINT}")
    return p


def cli_binary() -> str:
    p = _which("redis-cli", "valkey-cli")
    if p is None:
        raise HarnessError(f"redis-cli not found: {SETUP_HINT}")
    return p


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pdeathsig() -> None:  # runs in the child before exec
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


_LIVE: set = set()  # RedisServer / RedisCluster3 not yet closed


@atexit.register
def _close_all() -> None:
    for obj in list(_LIVE):
        try:
            obj.close()
        except Exception:
            pass


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def make_tls_files(d: Path) -> None:
    """Self-signed CA (ca.crt) and a server cert for 127.0.0.1/localhost signed by it, via the openssl CLI."""
    ossl = shutil.which("openssl")
    if ossl is None:
        raise HarnessError("openssl not found: run scripts/setup test (installs the Debian package openssl)")
    (d / "ca.cnf").write_text(
        "[req]\ndistinguished_name = dn\nprompt = no\nx509_extensions = v3_ca\n"
        "[dn]\nCN = kvtier-test-ca\n"
        "[v3_ca]\nbasicConstraints = critical, CA:TRUE\nkeyUsage = critical, keyCertSign, cRLSign\n"
        "subjectKeyIdentifier = hash\n")
    (d / "server.cnf").write_text(
        "[req]\ndistinguished_name = dn\nprompt = no\n[dn]\nCN = 127.0.0.1\n"
        "[v3_srv]\nbasicConstraints = critical, CA:FALSE\n"
        "keyUsage = critical, digitalSignature, keyEncipherment\nextendedKeyUsage = serverAuth\n"
        "subjectAltName = IP:127.0.0.1, DNS:localhost\n"
        "subjectKeyIdentifier = hash\nauthorityKeyIdentifier = keyid, issuer\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    steps = [
        [ossl, "req", "-x509", "-new", *ec, "-config", "ca.cnf", "-days", "7",
         "-keyout", "ca.key", "-out", "ca.crt"],
        [ossl, "req", "-new", *ec, "-config", "server.cnf", "-keyout", "server.key", "-out", "server.csr"],
        [ossl, "x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
         "-set_serial", str(secrets.randbits(63)), "-days", "7", "-extfile", "server.cnf",
         "-extensions", "v3_srv", "-out", "server.crt"],
    ]
    for cmd in steps:
        r = subprocess.run(cmd, cwd=d, capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise HarnessError(f"openssl failed ({' '.join(cmd[1:3])}): {r.stderr.strip().splitlines()[-1:]}")
    for f in ("ca.key", "server.key"):
        os.chmod(d / f, 0o600)


class RedisServer:
    """One `redis-server` on 127.0.0.1 with a generated config in a private temp dir.

    password: `requirepass` (AUTH <pw>). acl_user=(name, pw): that user with +@all; the default user
    is then off unless `password` is also given (then it keeps that password). tls: TLS only
    (`port 0`, `tls-port`), rediss:// URL, CA at `ca_path`. maxmemory ("256mb"): allkeys-lru.
    cluster: cluster-enabled node (bus on its own free port). extra: more config lines {key: value}.
    """

    def __init__(self, *, password: str | None = None, acl_user: tuple[str, str] | None = None,
                 tls: bool = False, maxmemory: str | None = None, cluster: bool = False,
                 cluster_node_timeout_ms: int = 5000, extra: dict[str, str] | None = None,
                 port: int | None = None, ready_timeout_s: float = READY_TIMEOUT_S) -> None:
        for s in [password, *(acl_user or ())]:
            if s is not None and not _SAFE.fullmatch(s):
                raise ValueError(f"use only [A-Za-z0-9_.-] in test credentials, got {s!r}")
        self.password, self.acl_user, self.tls = password, acl_user, tls
        self.maxmemory, self.cluster, self.extra = maxmemory, cluster, dict(extra or {})
        self.cluster_node_timeout_ms = cluster_node_timeout_ms
        self.ready_timeout_s = ready_timeout_s
        self.host = "127.0.0.1"
        self._fixed_port = port is not None
        self.port = port or 0
        self.bus_port = 0
        self.dir: Path | None = None
        self.proc: subprocess.Popen | None = None
        self._log = None

    # -- properties ------------------------------------------------------------------------
    @property
    def url(self) -> str:
        scheme = "rediss" if self.tls else "redis"
        if self.acl_user:
            cred = f"{quote(self.acl_user[0])}:{quote(self.acl_user[1])}@"
        elif self.password:
            cred = f":{quote(self.password)}@"
        else:
            cred = ""
        return f"{scheme}://{cred}{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def ca_path(self) -> str | None:
        return str(self.dir / "ca.crt") if self.tls and self.dir else None

    @property
    def log_path(self) -> Path:
        assert self.dir is not None
        return self.dir / "redis.log"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def client_kwargs(self) -> dict:
        """Extra redis-py kwargs this server needs besides its URL (the CA for TLS)."""
        return {"ssl_ca_certs": self.ca_path} if self.tls else {}

    def client(self, **kw) -> redis.Redis:
        return redis.Redis.from_url(self.url, **{**self.client_kwargs(), **kw})

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> "RedisServer":
        binary = server_binary()
        if self.dir is None:
            self.dir = Path(tempfile.mkdtemp(prefix="kvtier-redis-"))  # mode 0700
            _LIVE.add(self)
            if self.tls:
                make_tls_files(self.dir)
        for attempt in range(5):
            if not self._fixed_port and (attempt or not self.port):
                self.port = free_port()
                self.bus_port = 0
                while self.cluster and self.bus_port in (0, self.port):
                    self.bus_port = free_port()
            self._spawn(binary)
            try:
                self.wait_ready()
                return self
            except HarnessError:
                in_use = "Address already in use" in _tail(self.log_path, 50)
                self.kill()
                if not in_use or self._fixed_port:
                    raise
        raise HarnessError(f"redis-server: no free port after 5 tries\n{_tail(self.log_path)}")

    def _config(self) -> str:
        lines = [f"bind {self.host}", "protected-mode no", f'dir "{self.dir}"', 'save ""',
                 "appendonly no", "daemonize no", 'logfile ""', "enable-debug-command local"]
        if self.tls:
            lines += ["port 0", f"tls-port {self.port}", "tls-cert-file server.crt", "tls-key-file server.key",
                      "tls-ca-cert-file ca.crt", "tls-auth-clients no"]
        else:
            lines += [f"port {self.port}"]
        if self.maxmemory:
            lines += [f"maxmemory {self.maxmemory}", "maxmemory-policy allkeys-lru"]
        if self.password:
            lines += [f"requirepass {self.password}"]
        if self.acl_user:
            lines += [f"user {self.acl_user[0]} on >{self.acl_user[1]} ~* &* +@all"]
            if not self.password:
                lines += ["user default off"]
        if self.cluster:
            lines += ["cluster-enabled yes", "cluster-config-file nodes.conf",
                      f"cluster-node-timeout {self.cluster_node_timeout_ms}", f"cluster-port {self.bus_port}"]
            if self.tls:
                lines += ["tls-cluster yes"]
        lines += [f"{k} {v}" for k, v in self.extra.items()]
        return "\n".join(lines) + "\n"

    def _spawn(self, binary: str) -> None:
        conf = self.dir / "redis.conf"
        conf.write_text(self._config())
        if self._log is not None:
            self._log.close()
        self._log = open(self.log_path, "ab")
        self._log.write(f"--- kvtier harness: starting on port {self.port}\n".encode())
        self._log.flush()
        self.proc = subprocess.Popen([binary, str(conf)], cwd=self.dir, stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=_pdeathsig if sys.platform == "linux" else None)

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Poll PING until it answers; raise HarnessError (with the log's tail) at the deadline or if
        the process exits."""
        deadline = time.monotonic() + (timeout_s or self.ready_timeout_s)
        last: Exception | None = None
        c = self.client(socket_timeout=2, socket_connect_timeout=2)
        try:
            while True:
                if self.proc.poll() is not None:
                    raise HarnessError(f"redis-server on port {self.port} exited with {self.proc.returncode}:\n"
                                       f"{_tail(self.log_path)}")
                try:
                    if c.ping():
                        return
                except (redis.ConnectionError, redis.TimeoutError) as e:  # not up yet / still loading
                    last = e
                if time.monotonic() > deadline:
                    raise HarnessError(f"redis-server on port {self.port} not answering PING after "
                                       f"{timeout_s or self.ready_timeout_s:.0f} s ({last!r}):\n{_tail(self.log_path)}")
                time.sleep(0.05)
        finally:
            c.close()

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM, wait, then SIGKILL if it lingers. Files stay (restart() reuses them)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        """SIGKILL, as a crash would (no shutdown, connections reset)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def restart(self) -> "RedisServer":
        """Stop if running, start again on the same port and files; an empty db (save "")."""
        self.stop()
        self._spawn(server_binary())
        try:
            self.wait_ready()
        except HarnessError:
            self.kill()
            raise
        return self

    def close(self) -> None:
        """Stop and remove the temp dir."""
        try:
            self.stop()
        finally:
            if self._log is not None:
                self._log.close()
                self._log = None
            if self.dir is not None:
                shutil.rmtree(self.dir, ignore_errors=True)
                self.dir = None
            _LIVE.discard(self)

    def __enter__(self) -> "RedisServer":
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()


class RedisCluster3:
    """Three cluster-enabled masters on loopback (no replicas), joined with `redis-cli --cluster create`;
    ready once every node reports cluster_state:ok with all 16384 slots assigned and 3 known nodes."""

    def __init__(self, *, maxmemory: str | None = None, node_timeout_ms: int = 5000,
                 extra: dict[str, str] | None = None, ready_timeout_s: float = CLUSTER_TIMEOUT_S) -> None:
        """extra: config lines for every node, e.g. {"cluster-require-full-coverage": "no"} to keep the
        live nodes serving their slots once a killed node is marked failed (after node_timeout_ms)."""
        self.nodes = [RedisServer(cluster=True, maxmemory=maxmemory, cluster_node_timeout_ms=node_timeout_ms,
                                  extra=extra) for _ in range(3)]
        self.ready_timeout_s = ready_timeout_s
        self.startup_s: float | None = None  # how long start() took

    @property
    def url(self) -> str:
        return self.nodes[0].url

    @property
    def startup_nodes(self) -> list[redis.cluster.ClusterNode]:
        return [redis.cluster.ClusterNode(n.host, n.port) for n in self.nodes]

    def client(self, **kw) -> redis.cluster.RedisCluster:
        return redis.cluster.RedisCluster.from_url(self.url, **kw)

    def start(self) -> "RedisCluster3":
        t0 = time.monotonic()
        _LIVE.add(self)
        for n in self.nodes:
            n.start()
        cmd = [cli_binary(), "--cluster", "create", *(f"{n.host}:{n.port}" for n in self.nodes),
               "--cluster-replicas", "0", "--cluster-yes"]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=self.ready_timeout_s,
                               stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as e:
            raise HarnessError(f"redis-cli --cluster create timed out after {self.ready_timeout_s:.0f} s:\n"
                               f"{(e.stdout or b'')[-2000:]!r}") from None
        if r.returncode != 0:
            raise HarnessError(f"redis-cli --cluster create failed ({r.returncode}):\n"
                               f"{(r.stdout + r.stderr).strip()[-2000:]}")
        self.wait_ready(t0 + self.ready_timeout_s)
        self.startup_s = time.monotonic() - t0
        return self

    def wait_ready(self, deadline: float) -> None:
        want = {"cluster_state": "ok", "cluster_slots_assigned": "16384", "cluster_slots_ok": "16384",
                "cluster_known_nodes": "3"}
        clients = [n.client(socket_timeout=2, socket_connect_timeout=2) for n in self.nodes]
        state: dict = {}
        try:
            while True:
                ok = True
                for n, c in zip(self.nodes, clients):
                    if not n.running:
                        raise HarnessError(f"cluster node on port {n.port} exited:\n{_tail(n.log_path)}")
                    try:
                        info = c.execute_command("CLUSTER INFO")
                        if not isinstance(info, dict):  # redis-py parses it; raw text otherwise
                            info = dict(x.split(":", 1) for x in info.decode().split() if ":" in x)
                        info = {str(k): str(v) for k, v in info.items()}
                    except (redis.ConnectionError, redis.TimeoutError) as e:
                        info = {"error": repr(e)}
                    state[n.port] = {k: info.get(k) for k in want} if "error" not in info else info
                    ok = ok and all(info.get(k) == v for k, v in want.items())
                if ok:
                    return
                if time.monotonic() > deadline:
                    raise HarnessError(f"redis cluster not ready by the deadline: {state}")
                time.sleep(0.1)
        finally:
            for c in clients:
                c.close()

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()

    def close(self) -> None:
        for n in self.nodes:
            n.close()
        _LIVE.discard(self)

    def __enter__(self) -> "RedisCluster3":
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()
