"""`kvtier` command line: spill, restore, inspect, bench, replay."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from .config import ConfigError

log = logging.getLogger("kvtier")


def _common(p: argparse.ArgumentParser, config: bool = True) -> None:
    if config:
        p.add_argument("--config", "-c", default=None,
                       help="YAML tier stack (path or shipped name; default: the embedded cpu-nvme)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bars")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    ap = argparse.ArgumentParser(prog="kvtier", description="KV-cache tiering: CPU DRAM and NVMe tiers for LLM serving")
    ap.add_argument("--version", action="version", version=f"kvtier {__version__}")
    ap.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING (default), ERROR")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")

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

    p = sub.add_parser("inspect", help="what each tier holds, occupancy, engine, fingerprint")
    _common(p)

    p = sub.add_parser("bench", help="tier throughput next to this machine's own limits")
    _common(p)
    p.add_argument("--sizes", default="256KiB,512KiB,1MiB,2MiB", help="block sizes")
    p.add_argument("--total", default="256MiB", help="bytes moved per measurement")
    p.add_argument("--repeat", type=int, default=5, help="runs per figure (median reported)")
    p.add_argument("--dir", default=None, help="directory for the NVMe files (default: the config's nvme path)")
    p.add_argument("--skip-nvme", action="store_true")

    p = sub.add_parser("workload", help="write a generated Mooncake-format trace (kvtier.workloads)")
    p.add_argument("shape", choices=["agent", "chat", "rag", "api", "mix"])
    p.add_argument("--seed", type=int, default=1, help="seed (default 1: an evaluation seed; 0 is the tuning seed)")
    p.add_argument("--block-tokens", type=int, default=512)
    p.add_argument("--out", "-o", required=True, help="output JSONL (.gz to compress)")

    from . import replay
    replay.add_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
                        format="%(levelname)s %(name)s: %(message)s")
    if args.command is None:
        args = ap.parse_args(["replay"] + (argv or []))
    try:
        return int(_dispatch(args) or 0)
    except ConfigError as e:
        print(f"kvtier: config error: {e}", file=sys.stderr)
        return 2
    except (OSError, ValueError, KeyError) as e:
        print(f"kvtier: {args.command}: {e}", file=sys.stderr)
        return 2


def _dispatch(args: argparse.Namespace) -> Any:
    if args.command == "replay":
        from . import replay
        return replay.run(args)
    if args.command == "workload":
        from .workloads import generate, stats, write_trace
        reqs = generate(args.shape, args.seed, args.block_tokens)
        write_trace(reqs, args.out)
        print(f"{args.out}: {args.shape} seed {args.seed}: {stats(reqs, args.block_tokens)}")
        return 0
    from . import ops
    return {"spill": ops.cmd_spill, "restore": ops.cmd_restore, "inspect": ops.cmd_inspect,
            "bench": ops.cmd_bench}[args.command](args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
