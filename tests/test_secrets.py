"""No secret is ever printed (issue 33 item 5): strict encryption keys, and no Redis password in
any URL form in anything kvtier prints.

Keys: a key file holds exactly 32 raw bytes or 64 hex digits (one newline allowed), a variable
64 hex digits; anything else is one config line (exit 2; vLLM's start refused) naming the field
and the file or variable, never the key. Passwords: a real redis-server with `requirepass`, the
real CLI (spill, restore, inspect text and --json, bench --redis) with the password in each URL
form kvtier takes, the right one, a wrong one and no server at all: the password string is in no
stdout, stderr or log record.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.cli.main import main
from kvtier.core.config import ConfigError, parse_config
from kvtier.tiers.redact import redact
from kvtier.tiers.shared_conn import RedisSettings

ROOT = Path(__file__).resolve().parents[1]
KEY = bytes(range(200, 232))          # a raw key (not text)
PW = "Pw-s3cr3t-7Hq"                  # the server's password: must never be printed
WRONG = "Wr0ng-pw-K9z"                # a wrong one: never printed either


# ---- keys ---------------------------------------------------------------------------------------
def _nvme_cfg(tmp_path: Path, enc: str, name: str = "stack.yaml", data: str = "nvme") -> str:
    p = tmp_path / name
    p.write_text(f"""
block_bytes: 64KiB
tiers:
  - {{name: cpu, kind: cpu, capacity_blocks: 8}}
  - {{name: nvme, kind: nvme, path: {tmp_path}/{data}, capacity_blocks: 32, io: posix, encryption: {enc}}}
""")
    return str(p)


def _key_file(tmp_path: Path, name: str, data: bytes) -> str:
    p = tmp_path / name
    p.write_bytes(data)
    os.chmod(p, 0o600)
    return str(p)


GOOD_FILES = {"raw": KEY, "hex": KEY.hex().encode(), "hex-lf": KEY.hex().encode() + b"\n",
              "hex-crlf": KEY.hex().encode() + b"\r\n", "HEX": KEY.hex().upper().encode()}
BAD_FILES = {"hex-128-bit": KEY.hex()[:32].encode(),                 # 32 bytes: once taken as a raw key
             "hex-128-bit-lf": KEY.hex()[:32].encode() + b"\n",
             "passphrase-32": b"correct horse battery staple 123",   # 32 bytes of text
             "raw-33": KEY + b"\x01", "raw-lf": KEY + b"\n", "base64": b"yMnKy8zNzs/Q0dLT1NXW19jZ2tvc3d7f4OHi4+Tl5uc=\n",
             "empty": b"", "hex-two-lf": KEY.hex().encode() + b"\n\n", "hex-63": KEY.hex()[:63].encode() + b"\n"}


def test_key_file_takes_its_two_forms_only(tmp_path, capsys):
    """32 raw bytes or 64 hex digits (one newline) spill; any other content is one config line
    naming the field and the file and what it takes, exit 2, nothing written, no byte of the key."""
    for name, data in GOOD_FILES.items():
        p = _key_file(tmp_path, f"good-{name}", data)
        cfg = _nvme_cfg(tmp_path, f"{{key_file: {p}}}", data=f"nvme-{name}")
        assert main(["spill", "--config", cfg, "--blocks", "2", "-q"]) == 0, (name, capsys.readouterr().err)
    capsys.readouterr()
    for name, data in BAD_FILES.items():
        p = _key_file(tmp_path, f"bad-{name}", data)
        rc = main(["spill", "--config", _nvme_cfg(tmp_path, f"{{key_file: {p}}}", "bad.yaml"), "--blocks", "2", "-q"])
        out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1, (name, err)
        assert lines[0].startswith("kvtier: error: config error: ")
        assert f"tiers[nvme].encryption.key_file {p}: not a 256-bit key" in lines[0], (name, lines[0])
        assert lines[0].endswith("expected exactly 32 raw bytes, or 64 hex digits and at most one newline")
        body = data.strip()
        assert not body or body.decode("latin-1") not in out + err
        assert not (tmp_path / "nvme").exists(), name     # refused before anything was written


@pytest.mark.parametrize("value", [KEY.hex()[:32], "correct horse battery staple 123", "hunter2", "",
                                   "yMnKy8zNzs/Q0dLT1NXW19jZ2tvc3d7f4OHi4+Tl5uc=", KEY.hex() + "0"])
def test_key_env_takes_64_hex_digits_only(tmp_path, capsys, monkeypatch, value):
    monkeypatch.setenv("KVTIER_TEST_KEY", KEY.hex())
    monkeypatch.setenv("KVTIER_TEST_OLD", value)
    cfg = _nvme_cfg(tmp_path, "{key_env: KVTIER_TEST_KEY, read_keys: [{key_env: KVTIER_TEST_OLD}]}")
    rc = main(["spill", "--config", cfg, "--blocks", "2", "-q"])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    assert "tiers[nvme].encryption.read_keys[0].key_env $KVTIER_TEST_OLD: " in lines[0]
    assert lines[0].endswith("expected exactly 64 hex digits")
    assert not value or value not in out + err
    monkeypatch.setenv("KVTIER_TEST_OLD", KEY.hex().upper() + "\n")     # the one form, one newline
    assert main(["spill", "--config", cfg, "--blocks", "2", "-q"]) == 0


def test_a_bad_key_refuses_vllms_start_in_one_line(tmp_path, monkeypatch):
    """The class methods vLLM calls before it builds the connector read the keys: a 128-bit hex key
    refuses the start with the one line (`connector/start_check.py`), never the key."""
    from kvtier.connector.connector import KVTierConnector
    from kvtier.connector.start_check import StartRefused
    p = _key_file(tmp_path, "k", KEY.hex()[:32].encode() + b"\n")
    cfg = _nvme_cfg(tmp_path, f"{{key_file: {p}}}")
    with pytest.raises(StartRefused) as e:
        KVTierConnector.requires_piecewise_for_cudagraph({"config": cfg})
    line = e.value.code
    assert line.startswith(f"kvtier: error: {cfg}: tiers[nvme].encryption.key_file {p}: not a 256-bit key")
    assert "\n" not in line and KEY.hex()[:32] not in line
    monkeypatch.setenv("KVTIER_TEST_KEY", "a passphrase, not a key")
    with pytest.raises(StartRefused, match=r"encryption.key_env \$KVTIER_TEST_KEY: not a 256-bit key"):
        KVTierConnector.requires_piecewise_for_cudagraph({"config": _nvme_cfg(tmp_path, "{key_env: KVTIER_TEST_KEY}",
                                                                              "env.yaml")})
    _key_file(tmp_path, "k", KEY)
    assert KVTierConnector.requires_piecewise_for_cudagraph({"config": cfg}) is True


# ---- passwords ----------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _forms(srv, sock: str, pw: str) -> dict[str, tuple[str, str]]:
    """form -> (the shared tier's YAML fields, the URL a `bench --redis` takes or '')."""
    hp = f"{srv.host}:{srv.port}"
    return {"userinfo": (f'url: "redis://:{pw}@{hp}/0"', f"redis://:{pw}@{hp}/0"),
            "user-and-password": (f'url: "redis://default:{pw}@{hp}/0"', f"redis://default:{pw}@{hp}/0"),
            "query": (f'url: "redis://{hp}/0?password={pw}"', f"redis://{hp}/0?password={pw}"),
            "unix-query": (f'url: "unix://{sock}?db=0&password={pw}"', f"unix://{sock}?db=0&password={pw}"),
            "yaml-field": (f'url: "redis://{hp}/0", password: "{pw}"', ""),
            "env-url": ('url: "${KVTIER_TEST_SHARED_URL}"', "")}


def _shared_cfg(tmp_path: Path, fields: str, data: str = "a") -> str:
    p = tmp_path / "shared.yaml"
    p.write_text(f"""
block_bytes: 64KiB
model: secrets-test
tiers:
  - {{name: cpu, kind: cpu, capacity_blocks: 8}}
  - {{name: nvme, kind: nvme, path: {tmp_path}/{data}, capacity_blocks: 32, io: posix}}
  - {{name: shared, kind: redis, {fields}, timeout_s: 2, connect_timeout_s: 2}}
policy: {{demotion: write_back}}
""")
    return str(p)


class Printed:
    """Everything the commands printed and logged in one test: stdout, stderr, log records (their
    messages, arguments and tracebacks, as caplog formats them)."""

    def __init__(self, capsys, caplog) -> None:
        self.capsys, self.caplog, self.text = capsys, caplog, []

    def run(self, *argv: str) -> int:
        rc = main(list(argv))
        out, err = self.capsys.readouterr()
        self.text += [out, err]
        if "--json" in argv and out.strip():
            json.loads(out.strip().splitlines()[-1])   # still one valid JSON object
        return rc

    def all(self) -> str:
        return "\n".join(self.text + [self.caplog.text] + [repr(r.args) for r in self.caplog.records])


@pytest.fixture(scope="module")
def pw_server(tmp_path_factory):
    """One redis-server with `requirepass PW`, on TCP and on a unix socket."""
    sys.path.insert(0, str(ROOT / "tests"))
    import redis_util
    d = tmp_path_factory.mktemp("sock")
    srv = redis_util.RedisServer(password=PW, extra={"unixsocket": str(d / "r.sock"), "unixsocketperm": "700"})
    srv.start()
    yield srv, str(d / "r.sock")
    srv.close()


FORMS = ("userinfo", "user-and-password", "query", "unix-query", "yaml-field", "env-url")


def test_no_password_printed_by_the_cli(tmp_path, capsys, caplog, monkeypatch, pw_server):
    """Each form of giving the password; the right one (the commands work), a wrong one and a
    server that is not there (the error paths): neither password in any output, any log record or
    any --json object."""
    caplog.set_level(logging.DEBUG)
    srv, sock = pw_server
    dead = type("Dead", (), {"host": "127.0.0.1", "port": _free_port()})()
    for form in FORMS:
        p = Printed(capsys, caplog)
        caplog.clear()
        for i, (pw, where, ok) in enumerate(((PW, srv, True), (WRONG, srv, False), (PW, dead, False))):
            fields, url = _forms(where, sock if where is srv else str(tmp_path / "absent.sock"), pw)[form]
            monkeypatch.setenv("KVTIER_TEST_SHARED_URL", f"redis://{where.host}:{where.port}/0?password={pw}")
            cfg = _shared_cfg(tmp_path, fields, data=f"{form}-a{i}")
            assert p.run("spill", "--config", cfg, "--blocks", "4", "--seed", "3", "-q") == 0
            assert p.run("spill", "--config", cfg, "--blocks", "4", "--seed", "3", "-q", "--json") == 0
            cfg = _shared_cfg(tmp_path, fields, data=f"{form}-b{i}")     # nothing on disk: from the server
            rc = p.run("restore", "--config", cfg, "--verify", "-q")
            assert (rc == 0) == ok, (form, p.text[-1])
            assert p.run("restore", "--config", cfg, "--verify", "-q", "--json") == rc
            p.run("inspect", "--config", cfg)
            p.run("inspect", "--config", cfg, "--json")
            if url:
                rc = p.run("bench", "--skip-nvme", "--skip-cpu", "--skip-encrypted", "--redis", url, "--total",
                           "256KiB", "--repeat", "1", "--sizes", "128KiB", "--json")
                assert (rc == 0) == ok, (form, p.text[-2:])
        printed = p.all()
        assert ("***" in printed) == (form != "yaml-field"), form   # servers named, their URL's passwords hidden
        assert PW not in printed and WRONG not in printed, form


def test_no_password_printed_by_a_cli_process(tmp_path, pw_server):
    """The CLI as a process at DEBUG (tracebacks logged): the wrong password of a ?password= URL."""
    srv, _ = pw_server
    url = f"redis://{srv.host}:{srv.port}/0?password={WRONG}"
    cfg = _shared_cfg(tmp_path, f'url: "{url}"')
    for argv in (["restore", "--config", cfg, "--verify"], ["inspect", "--config", cfg, "--json"],
                 ["bench", "--skip-nvme", "--skip-cpu", "--redis", url, "--sizes", "128KiB", "--total", "256KiB"]):
        r = subprocess.run([sys.executable, "-m", "kvtier", "--log-level", "DEBUG", *argv], capture_output=True,
                           text=True, cwd=ROOT, timeout=120)
        assert WRONG not in r.stdout + r.stderr and f"{srv.port}/0?password=***" in r.stdout + r.stderr, r.stderr


def test_config_errors_and_reprs_never_show_a_password():
    """A bad URL's error, a password of the wrong type, the settings' and the config's repr/str."""
    base = [{"name": "cpu", "kind": "cpu", "capacity_blocks": 4}]
    for tier, shown in (({"url": f"http://:{PW}@h/0"}, "http://:***@h/0"),
                        ({"url": f"redis://h/0?password={PW}", "password": 12345}, "password: Input should be"),
                        ({"url": f"redis://h/0", "secret": 67890}, "secret: Input should be")):
        with pytest.raises(ConfigError) as e:
            parse_config({"tiers": base + [{"name": "s", "kind": "redis", **tier}]}, check_env=False)
        assert shown in str(e.value) and PW not in str(e.value) and "12345" not in str(e.value) \
            and "67890" not in str(e.value)
    cfg = parse_config({"tiers": base + [{"name": "s", "kind": "redis", "url": f"redis://u:{PW}@h/0?password={PW}",
                                          "password": PW, "secret": PW}]}, check_env=False)
    s = RedisSettings.of(cfg.tiers[1])
    for text in (repr(cfg), str(cfg), repr(cfg.tiers[1]), repr(s), str(s), s.where):
        assert PW not in text, text
    assert s.where == "redis://u:***@h/0?password=***"


@pytest.mark.parametrize("text, shown", [
    (f"redis://:{PW}@h:6379/0", "redis://:***@h:6379/0"),
    (f"rediss://alice:{PW}@h:6380/2", "rediss://alice:***@h:6380/2"),
    (f"redis://h:6379/0?password={PW}&db=1", "redis://h:6379/0?password=***&db=1"),
    (f"unix:///run/r.sock?db=0&password={PW}", "unix:///run/r.sock?db=0&password=***"),
    (f"unix://:{PW}@/run/r.sock", "unix://:***@/run/r.sock"),
    (f"redis://:{PW}@h:port/0", "redis://:***@h:port/0"),                 # not a URL urlsplit reads
    (f"Error connecting to redis://:{PW}@h:1/0 (refused)", "Error connecting to redis://:***@h:1/0 (refused)"),
    (f"Connection(password='{PW}', host='h')", "Connection(password='***', host='h')"),
    (f'{{"password": "{PW}", "hit_tokens": 3}}', '{"password": "***", "hit_tokens": 3}'),
    (f"  password: {PW}", "  password: ***"),
    ("redis://h:6379/0", "redis://h:6379/0"), ("tiers.1.password: Input should be", "tiers.1.password: Input should be"),
])
def test_redact(text, shown):
    assert redact(text) == shown


# ---- in vLLM ------------------------------------------------------------------------------------
@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_no_password_in_vllms_start_state_or_trace(tmp_path, monkeypatch, capsys, caplog, pw_server):
    """kvtier in real vLLM with `redis_url` holding `?password=`: the connector's start lines, every
    log record, the server's state file (and `kvtier inspect --server`) and the recorded trace
    name the server with `***` for the password; blocks still reach the server (the URL works)."""
    import vllm_util as U
    if not U.vllm_available():
        pytest.skip("vLLM not installed")
    srv, _ = pw_server
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("KVTIER_RUN_DIR", str(tmp_path / "run"))
    U.set_env()
    model = U.build_tiny_llama(tmp_path / "m")
    trace = tmp_path / "trace.jsonl"
    url = f"redis://{srv.host}:{srv.port}/0?password={PW}"
    llm = U.make_llm(model, U.kvtier_config(cpu_capacity_blocks=8, redis_url=url, model_identity="secrets-test",
                                            record_trace=str(trace)))
    try:
        U.generate(llm, U.prompts(2, 3, seed=5), max_tokens=2)
        assert main(["inspect", "--server"]) == 0
        assert srv.client().dbsize() > 0                # the blocks reached the password-protected server
        metrics = _metrics_text(llm)
    finally:
        U.shutdown(llm)
    out, err = capsys.readouterr()
    state = "".join(p.read_text() for p in (tmp_path / "run").glob("*.json"))
    printed = "\n".join([out, err, caplog.text, state, trace.read_text()[:4096], metrics] +
                        [repr(r.args) for r in caplog.records])
    assert 'tier="shared"' in metrics
    assert "kvtier connector (scheduler) started" in caplog.text and state
    assert f"{srv.port}/0?password=***" in caplog.text
    assert PW not in printed


def _metrics_text(llm) -> str:
    """/metrics as vLLM's API server makes it: the connector's `build_prom_metrics` on this
    engine's config, fed the scheduler's totals, rendered by prometheus_client."""
    import prometheus_client

    import kvtier.connector as C
    reg = prometheus_client.CollectorRegistry()
    types = {}
    for base in (prometheus_client.Counter, prometheus_client.Gauge, prometheus_client.Histogram):
        types[base] = type(base.__name__, (base,), {"__init__": lambda self, *a, _b=base, **k:
                                                     _b.__init__(self, *a, registry=reg, **k)})
    sc = [c for c in C.live_connectors("scheduler") if c.sched is not None][0]
    m = type(sc).build_prom_metrics(llm.llm_engine.vllm_config, types, ["model_name", "engine"], {0: ["tiny", "0"]})
    m.observe(dict(sc.sched.totals))
    return prometheus_client.generate_latest(reg).decode()


def test_plan_suggests_no_password(tmp_path, capsys):
    """`kvtier plan`'s suggested YAML of a stack whose shared tier has a password in its URL: the
    URL comes from $KVTIER_REDIS_URL, its default shown with `***`; the YAML still loads."""
    from kvtier.offline.workloads import generate, write_trace
    trace = tmp_path / "chat.jsonl"
    write_trace(generate("chat", seed=1, block_tokens=128, conversations=40, duration_s=120), trace, 128)
    for url in (f"redis://127.0.0.1:6390/0?password={PW}", f"redis://:{PW}@127.0.0.1:6390/0"):
        cfg = tmp_path / "s.yaml"
        cfg.write_text("block_bytes: 1MiB\nblock_tokens: 128\ntiers:\n  - {name: cpu, kind: cpu, capacity: 1GiB}\n"
                       f"  - {{name: shared, kind: redis, url: '{url}'}}\n")
        assert main(["plan", "--trace", str(trace), "-c", str(cfg), "--target-hit", "0.5"]) == 0
        assert main(["plan", "--trace", str(trace), "-c", str(cfg), "--target-hit", "0.5", "--json"]) == 0
        out, err = capsys.readouterr()
        assert "${KVTIER_REDIS_URL:-redis://" in out and "***" in out
        assert PW not in out + err
