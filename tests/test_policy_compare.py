"""kvtier replay --compare: the default next to the yardsticks, text and JSON."""

import json

from kvtier.cli.main import main
from kvtier.offline.compare import compare, gap_closed
from kvtier.offline.workloads import generate


def test_compare_rows_and_gap():
    reqs = generate("chat", 1, conversations=150)
    d = compare(reqs, "lru+second_hit", fractions=(0.05, 0.1))
    assert [p["fraction"] for p in d["points"]] == [0.05, 0.1]
    for p in d["points"]:
        rows = p["policies"]
        assert list(rows) == ["lru+second_hit", "vllm_lru", "lru", "arc", "s3fifo", "belady"]
        assert rows["vllm_lru"]["gap_closed"] in (0.0, None)
        for r in rows.values():
            assert 0.0 <= r["hit_ratio"] <= rows["belady"]["hit_ratio"] + 1e-9
            assert 0.0 <= r["token_hit_ratio"] <= 1.0
    assert abs(gap_closed(0.3, 0.2, 0.4) - 0.5) < 1e-9 and gap_closed(0.3, 0.2, 0.2) is None


def test_replay_compare_cli(tmp_path, capsys):
    from kvtier.offline.workloads import write_trace
    t = tmp_path / "t.jsonl"
    write_trace(generate("api", 1, requests=300), t)
    assert main(["replay", "--trace", str(t), "--compare", "--capacity-blocks", "20", "--json"]) == 0
    d = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert d["points"][0]["capacity_blocks"] == 20
    assert {"vllm_lru", "lru", "arc", "s3fifo", "belady", d["default"]} <= set(d["points"][0]["policies"])
    assert main(["replay", "--trace", str(t), "--compare", "--policy", "vllm_lru"]) == 0
    out = capsys.readouterr().out
    assert "1% of unique" in out and "10% of unique" in out and "(default)" in out and "belady" in out
