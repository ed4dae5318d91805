"""The shutdown handoff of the workers' last NVMe report through the tier directory (no vLLM run)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm")

from kvtier.connector.handoff import clear_reports, read_reports, write_report  # noqa: E402
from kvtier.connector.metadata import KVTierWorkerMeta  # noqa: E402


def test_reports_round_trip_per_rank(tmp_path):
    d = str(tmp_path)
    write_report(d, KVTierWorkerMeta(rank=0, copied={7: [11, -1], 8: [12]}))
    p = write_report(d, KVTierWorkerMeta(rank=1, copied={7: [21, 22], 8: [23]}))
    assert oct(os.stat(p).st_mode & 0o777) == "0o600"
    m = read_reports(d)
    assert m.written_by_rank() == {7: {0: [11, -1], 1: [21, 22]}, 8: {0: [12], 1: [23]}}
    assert read_reports(d) is None          # consumed


def test_bad_or_stale_reports(tmp_path):
    d = str(tmp_path)
    (tmp_path / "shutdown-report.0.json").write_text("{not json")
    assert read_reports(d) is None and not os.listdir(d)
    write_report(d, KVTierWorkerMeta(rank=0, copied={1: [5]}))
    os.symlink(str(tmp_path / "elsewhere"), str(tmp_path / "shutdown-report.3.json"))
    assert clear_reports(d) == 2 and not os.listdir(d)
