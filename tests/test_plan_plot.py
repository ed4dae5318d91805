"""`kvtier plan --png`: the plot shows every configured tier and its cost panel says where its
prefill speed comes from; Belady on a large trace runs on a sample with its error stated."""

from __future__ import annotations

import json

import pytest

import kvtier.offline.sizing as S
from kvtier.cli.main import main
from kvtier.offline.belady import belady
from kvtier.offline.trace import load_trace
from kvtier.offline.workloads import generate, write_trace


@pytest.fixture(scope="module")
def chat128(tmp_path_factory):
    p = tmp_path_factory.mktemp("plot") / "chat.jsonl"
    write_trace(generate("chat", seed=1, block_tokens=128, conversations=200, duration_s=600), p, 128)
    return p


def _overlap(a, b) -> bool:
    return a[1] < b[3] and b[1] < a[3] and a[2] < b[4] and b[2] < a[4]


def test_the_axes_cover_every_tier_and_labels_never_overlap(tmp_path, capsys, chat128):
    """Tiers of 16 and 64 GiB (1 MiB blocks) over a trace of far fewer unique blocks: the x axis
    reaches both marks; three tiers at the same reach get three labels that do not overlap."""
    cfg = tmp_path / "s.yaml"
    cfg.write_text("block_bytes: 1MiB\nblock_tokens: 128\ntiers:\n  - {name: cpu, kind: cpu, capacity: 16GiB}\n"
                   f"  - {{name: nvme, kind: nvme, path: {tmp_path}/nv, capacity: 64GiB}}\n"
                   f"  - {{name: nvme2, kind: nvme, path: {tmp_path}/nv2, capacity: 64GiB}}\npolicy: {{eviction: lru}}\n")
    png = tmp_path / "p.png"
    assert main(["plan", "--trace", str(chat128), "-c", str(cfg), "--png", str(png), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["unique_blocks"] << 20 < 16 << 30               # the curve alone would stop short of 16 GiB
    lo, hi = rep["png_layout"]["x_range_bytes"]
    assert lo <= 1 << 20 and hi >= 64 << 30
    labels = rep["png_layout"]["labels"]
    assert [x[0] for x in labels] == ["cpu", "nvme", "nvme2"]
    assert not any(_overlap(a, b) for i, a in enumerate(labels) for b in labels[i + 1:])
    assert png.stat().st_size > 10_000
    assert rep["cost_model"]["prefill_source"] == "assumed (default)"


def test_the_cost_panel_takes_the_prefill_speed_the_trace_states(tmp_path, capsys):
    t = tmp_path / "rec.jsonl"
    head = {"kvtier_trace": {"block_tokens": 32, "block_bytes": 32768, "prefill_tokens_per_s": 1234.5}}
    rows = [head] + [{"timestamp": i, "input_length": 32 * 3 + 1, "output_length": 1, "hash_ids": [1, 2, 3 + i % 4]}
                     for i in range(50)]
    t.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["plan", "--trace", str(t), "--png", str(tmp_path / "p.png"), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["cost_model"]["prefill_tokens_per_s"] == 1234.5
    assert rep["cost_model"]["prefill_source"].startswith("measured by the server")
    assert main(["plan", "--trace", str(t), "--prefill-tokens-per-s", "900", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cost_model"]["prefill_tokens_per_s"] == 900


def test_belady_on_a_sample_is_within_its_stated_error(monkeypatch, chat128, capsys):
    """Past BELADY_EXACT_REFS references plan's Belady points come from a sample of the blocks;
    each is within the stated error of the exact MIN, and plan says it sampled."""
    reqs = load_trace(chat128)
    refs = sum(len(r.hash_ids) for r in reqs)
    monkeypatch.setattr(S, "BELADY_EXACT_REFS", refs // 4)
    monkeypatch.setattr(S, "BELADY_SAMPLE_REFS", refs // 3)
    u = len({b for r in reqs for b in r.hash_ids})
    caps = [u // 50, u // 10, u // 4]
    got = S.belady_points(reqs, caps, 128)
    assert 0.3 < got["sample_rate"] < 0.4 and 0 < got["error"] < 0.1
    for p in got["points"]:
        exact = belady(reqs, p["capacity_blocks"], 128, vllm=True)["hit_ratio"]
        assert abs(p["hit_ratio"] - exact) <= got["error"], (p, exact)
    assert main(["plan", "--trace", str(chat128), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["belady_method"]["sample_rate"] < 1 and rep["belady_method"]["error"] > 0
    assert main(["plan", "--trace", str(chat128)]) == 0
    assert "Belady on a sample of the blocks at rate" in capsys.readouterr().out
