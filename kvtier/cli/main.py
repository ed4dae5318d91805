"""`kvtier` command line: spill, restore, inspect, bench, replay, plan."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from kvtier.core.config import ConfigError

log = logging.getLogger("kvtier")


class _Parser(argparse.ArgumentParser):
    """argparse with kvtier's one-line error (`kvtier: error: ...`, exit 2) and no abbreviated
    options (`--block 100` is an error, not `--blocks 100`)."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        kw.setdefault("allow_abbrev", False)
        super().__init__(*a, **kw)

    def error(self, message: str):  # type: ignore[override]
        where = self.prog.removeprefix("kvtier").strip()
        print(f"kvtier: error: {where + ': ' if where else ''}{message} (see {self.prog} --help)", file=sys.stderr)
        if "--json" in sys.argv:
            print(json.dumps({"error": {"message": message, "exit": 2, "command": self.prog}}))
        sys.exit(2)


def _common(p: argparse.ArgumentParser, config: bool = True) -> None:
    if config:
        p.add_argument("--config", "-c", default=None,
                       help="YAML tier stack (path or shipped name; default: the embedded cpu-nvme)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bars")


def build_parser() -> argparse.ArgumentParser:
    from kvtier import __version__
    ap = _Parser(prog="kvtier", description="KV-cache tiering: CPU DRAM and NVMe tiers for LLM serving")
    ap.add_argument("--version", action="version", version=f"kvtier {__version__}")
    ap.add_argument("--log-level", default="WARNING",
                    help="DEBUG, INFO, WARNING (default), ERROR; the one line a command prints when it opens "
                         "its tiers (what, where, I/O engine) shows unless -q or ERROR")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser("spill", help="write N deterministic blocks through the stack down to NVMe")
    _common(p)
    p.add_argument("--blocks", "-n", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=64, help="blocks per put (default 64)")
    p.add_argument("--commit-log", default=None, help="append each committed batch's last index here (fsynced)")

    p = sub.add_parser("restore", help="reopen the stack and read back every block in the NVMe index")
    _common(p)
    p.add_argument("--verify", action="store_true", help="compare contents to the regenerated spill data")
    p.add_argument("--seed", type=int, default=None, help="seed of the spill (default: from its manifest)")
    p.add_argument("--strict", action="store_true", help="exit 1 when any block is corrupt or missing")

    p = sub.add_parser("inspect", help="what each tier holds, occupancy, engine, fingerprint (read-only, no lock)")
    _common(p)
    p.add_argument("--watch", type=float, default=None, metavar="SECONDS",
                   help="refresh every SECONDS until Ctrl-C (a live server's directory too)")
    p.add_argument("--count", type=int, default=None, help="with --watch: stop after COUNT refreshes")
    p.add_argument("--server", nargs="?", type=int, const=0, default=None, metavar="PID",
                   help="the running vLLM servers (or the one of PID) as they report themselves: directories, "
                        "geometry, counters; no --config needed")

    p = sub.add_parser("fsck", help="check the NVMe tier against its block headers; --rebuild the index")
    _common(p)
    p.add_argument("--rebuild", action="store_true",
                   help="rebuild the index from the data file's block headers (the old one is kept aside)")
    p.add_argument("--shrink", action="store_true",
                   help="with --rebuild: keep only slots within the configured capacity, reporting the rest")
    p.add_argument("--dir", default=None,
                   help="check this NVMe tier directory (e.g. the vLLM connector's) under the fingerprint it "
                        "recorded, instead of --config's nvme tier")

    p = sub.add_parser("bench", help="tier throughput next to this machine's own limits")
    _common(p)
    p.add_argument("--sizes", default="256KiB,512KiB,1MiB,2MiB", help="block sizes")
    p.add_argument("--total", default="256MiB", help="bytes moved per measurement")
    p.add_argument("--repeat", type=int, default=5, help="runs per figure (median reported)")
    p.add_argument("--dir", default=None, help="directory for the NVMe files (default: the config's nvme path)")
    p.add_argument("--skip-nvme", action="store_true")
    p.add_argument("--redis", default=None, metavar="URL",
                   help="bench the shared tier on this server (default: the config's redis tier, if any)")
    p.add_argument("--redis-cluster", action="store_true", help="--redis URL names a Redis Cluster node")
    p.add_argument("--redis-threads", type=int, default=4, help="the data plane's pipelines in flight (io_threads)")
    p.add_argument("--skip-redis", action="store_true")
    p.add_argument("--skip-cpu", action="store_true")
    p.add_argument("--skip-encrypted", action="store_true",
                   help="no encrypted nvme / shared rows (AES-256-GCM tiers against the plain ones, same run)")

    p = sub.add_parser("workload", help="write a generated Mooncake-format trace (kvtier.offline.workloads)")
    p.add_argument("shape", choices=["agent", "chat", "rag", "api", "mix", "tenants"],
                   help="tenants: two tenants, one's burst over the other's steady traffic")
    p.add_argument("--seed", type=int, default=1, help="seed (default 1: an evaluation seed; 0 is the tuning seed)")
    p.add_argument("--block-tokens", type=int, default=512)
    p.add_argument("--out", "-o", required=True, help="output JSONL (.gz to compress)")

    from kvtier.cli import demo, plan
    from kvtier.cli import replay
    replay.add_parser(sub)
    plan.add_parser(sub)
    demo.add_parser(sub)
    return ap


class _Redacting(logging.Formatter):
    """Every line (a traceback too) through `redact`: no password is ever printed."""

    def format(self, record: logging.LogRecord) -> str:
        from kvtier.tiers.redact import redact
        return redact(super().format(record))


class _Formatter(_Redacting):
    """The CLI's log lines: `LEVEL logger: message`, without a second `kvtier:` prefix."""

    def format(self, record: logging.LogRecord) -> str:
        return super().format(record).replace(": kvtier: ", ": ", 1)


class _StderrHandler(logging.StreamHandler):
    """A handler writing to whatever sys.stderr is when a line is logged."""

    @property  # type: ignore[override]
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


_STARTUP = _StderrHandler()
_STARTUP.setFormatter(_Redacting("%(message)s"))


class _Terminated(BaseException):
    """SIGTERM, raised in the main thread so `finally` blocks close the index."""


def _on_sigterm(signum, frame):  # pragma: no cover - exercised by subprocess tests
    raise _Terminated()


def _exit_code(e: BaseException) -> int:
    """2: bad input (config, arguments, a directory of another fingerprint or capacity, or not
    kvtier's); 1: runtime."""
    from kvtier.tiers.nvme_dir import FingerprintMismatch, ForeignDirectory
    from kvtier.tiers.nvme_recovery import CapacityShrink
    if isinstance(e, (ConfigError, CapacityShrink, FingerprintMismatch, ForeignDirectory)):
        return 2
    if isinstance(e, OSError):
        return 1
    if isinstance(e, (ValueError, KeyError)):
        return 2
    return 1


def _error_line(e: BaseException) -> str:
    from kvtier.tiers.nvme_index import NvmeIndexError
    if isinstance(e, ConfigError):
        return f"config error: {e}".replace("\n  ", "; ")
    if isinstance(e, OSError) and e.errno and e.strerror:
        import errno as _errno
        name = _errno.errorcode.get(e.errno, str(e.errno))
        msg = e.strerror
        if e.filename and str(e.filename) not in msg:
            msg += f": {e.filename}"
        return msg if name in msg else f"{msg} [{name}]"
    if isinstance(e, (ValueError, KeyError, OSError, NvmeIndexError, RuntimeError)):
        return str(e)
    return f"internal error: {type(e).__name__}: {e} (please report; --log-level DEBUG shows the traceback)"


def _fail(args: argparse.Namespace, msg: str, code: int, result: dict | None = None) -> int:
    from kvtier.tiers.redact import redact, redact_all
    msg = redact(" ".join(msg.split()))
    result = redact_all(result)
    if getattr(args, "json", False):
        out = {"error": {"message": msg, "exit": code, "command": getattr(args, "command", None)}}
        if result is not None:
            out["result"] = result
        print(json.dumps(out, default=str), flush=True)
    print(f"kvtier: error: {msg}", file=sys.stderr, flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    level = getattr(logging, str(args.log_level).upper(), None)
    if not isinstance(level, int):
        print(f"kvtier: error: --log-level {args.log_level!r}: expected DEBUG, INFO, WARNING or ERROR",
              file=sys.stderr)
        return 2
    if args.command is None:   # bare `kvtier`: what it can do, not a multi-GB replay
        ap.print_help(sys.stderr)
        print("kvtier: error: no COMMAND given (scripts/run with no arguments runs `kvtier replay`)",
              file=sys.stderr)
        return 2
    if not logging.getLogger().handlers:
        h = _StderrHandler()
        h.setFormatter(_Formatter("%(levelname)s %(name)s: %(message)s"))
        logging.basicConfig(level=level, handlers=[h])
    # the one line a command prints when it opens its tiers: shown at the default level, and not
    # as an INFO log line (the default level is WARNING)
    startup = logging.getLogger("kvtier.startup")
    if not getattr(args, "quiet", False) and level <= logging.WARNING:
        if _STARTUP not in startup.handlers:
            startup.addHandler(_STARTUP)
        startup.setLevel(logging.INFO)
        startup.propagate = False
    else:
        startup.removeHandler(_STARTUP)
        startup.setLevel(logging.NOTSET)
        startup.propagate = True
    import signal
    import threading
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
    from kvtier.cli.common import CommandFailed
    try:
        return int(_dispatch(args) or 0)
    except CommandFailed as e:
        return _fail(args, str(e), e.code, e.result)
    except KeyboardInterrupt:
        return _fail(args, "interrupted (SIGINT); the index is consistent: committed blocks stay", 130)
    except _Terminated:
        return _fail(args, "terminated (SIGTERM); the index is consistent: committed blocks stay", 143)
    except RecursionError:
        return _fail(args, "input nested too deeply", 2)
    except Exception as e:  # one line, never a traceback (DEBUG logs it)
        log.debug("traceback", exc_info=True)
        return _fail(args, _error_line(e), _exit_code(e))


def _dispatch(args: argparse.Namespace) -> Any:
    if args.command == "replay":
        from kvtier.cli import replay
        return replay.run(args)
    if args.command == "demo":
        from kvtier.cli import demo
        return demo.run(args)
    if args.command == "plan":
        from kvtier.cli import plan
        return plan.run(args)
    if args.command == "workload":
        from kvtier.offline.workloads import generate, stats, write_trace
        reqs = generate(args.shape, args.seed, args.block_tokens)
        write_trace(reqs, args.out, args.block_tokens)
        print(f"{args.out}: {args.shape} seed {args.seed}: {stats(reqs, args.block_tokens)}")
        return 0
    if args.command == "spill":
        from kvtier.cli.spill import cmd_spill
        return cmd_spill(args)
    if args.command == "restore":
        from kvtier.cli.restore import cmd_restore
        return cmd_restore(args)
    if args.command in ("inspect", "fsck"):
        from kvtier.cli.inspect import cmd_fsck, cmd_inspect
        return (cmd_inspect if args.command == "inspect" else cmd_fsck)(args)
    if args.command == "bench":
        from kvtier.cli.bench import cmd_bench
        return cmd_bench(args)
    raise AssertionError(f"unknown command {args.command!r}")  # argparse refuses any other


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
