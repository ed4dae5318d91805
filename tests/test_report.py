"""One report type, built from a plan in one place (`Report.of_plan`): what moves nothing reports
(replay without data), and what cannot run (the connector's failed step)."""

from __future__ import annotations

from kvtier.core.plan import CopyOp, LoadOp, Plan, Report, StoreOp
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
    assert rep.loaded == {"a": False, "b": False} and rep.stored == {7: [False, False], 3: [False] * 3}
    assert rep.copied == {} and rep.written_by_rank() == {4: {0: [-1, -1], 1: [-1, -1]}}
