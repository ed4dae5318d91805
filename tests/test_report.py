"""One report type, built in one place (`ReportBuilder`): by an executor's parts op by op, or from
a whole plan (`Report.of_plan`: what moves nothing reports, what cannot run)."""

from __future__ import annotations

from kvtier.core.plan import CopyOp, LoadOp, Plan, Report, ReportBuilder, StoreOp
from kvtier.core.stack import NullExecutor


def _plan() -> Plan:
    return Plan(loads=[LoadOp("a", 1, [4, 5], [0, 1], via=[2, 3], op_id=7, via_tier=0), LoadOp("b", 0, [1], [2])],
                stores=[StoreOp(3, 0, [6, 7, 8], [3, 4, 5])],
                copies=[CopyOp(4, [6, 7], [0, 1], src_tier=0, tier=1)])


def test_a_plan_reported_done():
    rep = Report.of_plan(_plan(), ok=True)
    assert rep.loaded == {"a": True, "b": True} and rep.stored == {7: [True, True], 3: [True] * 3}
    assert rep.copied == {4: [0, 0]} and rep.copied_ranks == {}
    assert NullExecutor().run(_plan()) == rep


def test_a_plan_reported_failed_by_every_rank():
    rep = Report.of_plan(_plan(), ok=False, ranks=2)
    assert rep.loaded == {"a": False, "b": False}
    assert rep.stored_by_rank() == {7: {0: [False, False], 1: [False, False]}, 3: {0: [False] * 3, 1: [False] * 3}}
    assert rep.copied == {} and rep.written_by_rank() == {4: {0: [-1, -1], 1: [-1, -1]}}


def test_the_builder_adds_outcomes_and_hands_the_report_over_once():
    b = ReportBuilder(rank=1)
    b.loaded("r", True)
    b.loaded("r", False)                                  # a request's loads AND
    b.loaded("s", True)
    b.stored(3, [True, False])
    assert b.not_stored(3, 2, unless_reported=True) == 0  # already reported: kept
    assert b.not_stored(5, 3, unless_reported=True) == 3
    b.copied(4, [11, -1])
    b.copied(4, [12, 13], rank=0)
    b.corrupt(1, [7, 8])
    b.shared_misses([b"k1", b"k2"], [b"k2"])
    b.capacity({0: 16})
    assert b.load_failed("r") and not b.load_failed("s") and not b.load_failed("t")
    rep = b.take()
    assert rep == Report(stored={3: [True, False], 5: [False] * 3}, loaded={"r": False, "s": True},
                         copied={4: [11, -1]}, corrupt={1: [7, 8]}, rank=1, copied_ranks={4: {0: [12, 13]}},
                         gone=[b"k1", b"k2"], bad=[b"k2"], capacity={0: 16})
    assert b.take() is None and b.empty() == Report(rank=1)   # once; nothing since
    b.corrupt(0, [1])
    assert b.corrupt_blocks == 3                               # over every report


def test_every_part_of_the_executor_reports_through_its_builder():
    """No part of `kvtier.core` writes a report's fields but the builder (the handlers, copies
    down, deferred stores and failures call its methods)."""
    import ast
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[1] / "kvtier" / "core"
    fields = {"stored", "loaded", "copied", "corrupt", "copied_ranks", "gone", "bad", "capacity"}
    hits = []
    for f in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            # `<x>.result.<field>`: the old executor attribute, written in place
            if isinstance(node, ast.Attribute) and node.attr in fields and isinstance(node.value, ast.Attribute) \
                    and node.value.attr in ("result", "_rep") and f.name != "plan.py":
                hits.append(f"{f.name}:{node.lineno}")
    assert hits == []
