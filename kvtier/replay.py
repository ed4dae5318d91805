"""`kvtier replay`: real traffic through the real stack (placeholder until the policy work lands)."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("replay", help="replay a Mooncake-format trace through the stack")
    p.add_argument("--json", action="store_true")
    p.add_argument("--quiet", "-q", action="store_true")


def run(args: argparse.Namespace) -> int:
    raise NotImplementedError("replay is not wired yet")
