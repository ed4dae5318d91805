"""What a trace says about itself, checked: its block size against its lengths, its recorded
geometry over a YAML's, mixed traces, undecodable and torn lines (kvtier.offline.trace)."""

from __future__ import annotations

import json

import pytest

from kvtier.cli.main import main
from kvtier.offline.trace import TraceError, bundled_trace, load_trace
from kvtier.offline.workloads import generate, write_trace


def _lines(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_ids_of_64_token_blocks_without_block_tokens_are_refused(tmp_path, capsys):
    """A trace from another tool: 64-token ids, no block_tokens field. Read as 512-token blocks it
    replays to a fraction of its hits; it is refused with the field and the size its lengths imply,
    and replays right with the field set or with --trust-block-tokens (the old reading)."""
    reqs = generate("chat", seed=1, block_tokens=64, conversations=300, duration_s=600)
    bare, tagged = tmp_path / "bare.jsonl", tmp_path / "tagged.jsonl"
    write_trace(reqs, bare)
    write_trace(reqs, tagged, 64)
    with pytest.raises(TraceError, match=r"bare.jsonl: field block_tokens \(absent: 512\).* about 64 tokens"):
        load_trace(bare)
    for cmd in ("replay", "plan"):
        assert main([cmd, "--trace", str(bare), "--no-belady", "-q"] + (["--no-data"] if cmd == "replay" else [])) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "block_tokens" in err[0] and "about 64 tokens" in err[0]
    runs = {}
    for name, extra in (("tagged", []), ("trusted", ["--trust-block-tokens"])):
        trace = tagged if name == "tagged" else bare
        assert main(["replay", "--trace", str(trace), "--capacity-blocks", "4000", "--no-data", "--no-belady",
                     "--json", "-q"] + extra) == 0
        runs[name] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert runs["tagged"]["block_tokens"] == 64 and runs["trusted"]["block_tokens"] == 512
    assert runs["tagged"]["hit_ratio"] > 3 * runs["trusted"]["hit_ratio"]


def test_the_bundled_trace_is_accepted():
    assert len(load_trace(bundled_trace())) == 12031


@pytest.mark.parametrize("bt", [512, 64])
def test_generated_workloads_are_accepted(tmp_path, bt):
    for shape in ("agent", "chat", "rag", "api"):
        p = tmp_path / f"{shape}.jsonl"
        write_trace(generate(shape, seed=1, block_tokens=bt)[:3000], p, bt if bt != 512 else None)
        assert load_trace(p).block_tokens == bt


def test_a_recorded_geometry_is_used_over_the_config(tmp_path, capsys):
    """The header of a recorded trace (128-token blocks of 1 MiB) sizes the tiers, said in one line;
    the suggested YAML is in that geometry."""
    t = tmp_path / "rec.jsonl"
    head = {"kvtier_trace": {"version": 1, "block_tokens": 128, "block_bytes": 1 << 20, "model": "sha256:ab",
                             "kv_dtype": "bfloat16"}}
    rows = [head] + [{"timestamp": i, "input_length": 128 * 4 + 3, "output_length": 1,
                      "hash_ids": [1, 2, 3 + i % 5, 100 + i]} for i in range(200)]
    _lines(t, rows)
    assert main(["plan", "--trace", str(t), "--target-hit", "30%", "--no-belady", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert (rep["block_tokens"], rep["block_bytes"]) == (128, 1 << 20)
    assert "the trace's geometry" in rep["geometry_note"] and "1.00 MiB" in rep["geometry_note"]
    assert "block_bytes: 1MiB" in rep["suggestion"]["yaml"] and "block_tokens: 128" in rep["suggestion"]["yaml"]
    assert rep["suggestion"]["capacity_bytes"]["cpu"] == rep["suggestion"]["capacity_blocks"] << 20
    assert main(["plan", "--trace", str(t), "--no-belady"]) == 0
    out = capsys.readouterr().out
    assert sum("geometry:" in ln for ln in out.splitlines()) == 1
    assert main(["replay", "--trace", str(t), "--no-data", "--no-belady", "--json", "-q"]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out.strip().splitlines()[-1])["block_bytes"] == 1 << 20
    assert sum("the trace's geometry" in ln for ln in cap.err.splitlines()) == 1


def test_a_mixed_trace_is_refused_at_the_first_line_that_differs(tmp_path):
    t = tmp_path / "mixed.jsonl"
    req = {"timestamp": 0, "input_length": 70, "output_length": 1, "hash_ids": [1, 2]}
    g = {"block_tokens": 32, "block_bytes": 65536, "model": "a", "kv_dtype": "float32"}
    _lines(t, [{"kvtier_trace": g}, req, req, {"kvtier_trace": {**g, "model": "b"}}, req])
    with pytest.raises(TraceError, match=r"mixed.jsonl:4: a mixed trace: model 'b' here, 'a' at line 1"):
        load_trace(t)
    _lines(t, [{"kvtier_trace": g}, req, {"kvtier_trace": g}, req])   # a restart of the same server: one trace
    assert len(load_trace(t)) == 2


def test_non_utf8_names_path_and_line(tmp_path, capsys):
    t = tmp_path / "bin.jsonl"
    ok = json.dumps({"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]})
    t.write_bytes(ok.encode() + b"\n" + b'{"timestamp": 1, "x": "\xff\xfe"}\n' + ok.encode() + b"\n")
    assert main(["replay", "--trace", str(t), "--no-data", "-q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{t}:2: not UTF-8" in err[0]


def test_a_torn_last_line_is_skipped_with_a_warning(tmp_path, capsys):
    """A writer stopped mid-line (an old recorder on a full disk): plan and replay read the rest."""
    t = tmp_path / "torn.jsonl"
    rows = [{"timestamp": i, "input_length": 1100, "output_length": 1, "hash_ids": [1, 2, 3 + i]} for i in range(20)]
    t.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"timestamp": 20, "input_len')
    assert len(load_trace(t)) == 20 and "torn last line" in load_trace(t).warnings[0]
    assert main(["plan", "--trace", str(t), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["requests"] == 20 and any(f"{t}:21: skipped a torn last line" in w for w in rep["warnings"])
    assert main(["replay", "--trace", str(t), "--no-data", "--json", "-q"]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out.strip().splitlines()[-1])["requests"] == 20 and "torn last line" in cap.err
    t.write_text("".join(json.dumps(r) + "\n" for r in rows[:3]) + "{broken\n" + json.dumps(rows[3]) + "\n")
    with pytest.raises(TraceError, match=r"torn.jsonl:4: not valid JSON"):   # a bad line inside is still an error
        load_trace(t)


def test_replay_warns_on_ids_repeated_inside_a_request(tmp_path, capsys):
    t = tmp_path / "rep.jsonl"
    _lines(t, [{"timestamp": i, "input_length": 1600, "output_length": 1, "hash_ids": [7, 8, 7]} for i in range(5)])
    assert main(["replay", "--trace", str(t), "--no-data", "-q"]) == 0
    err = capsys.readouterr().err
    assert "5 requests repeat a block id inside the request (the first at line 1)" in err
    assert main(["plan", "--trace", str(t), "--json"]) == 0
    assert any("repeat a block id" in w for w in json.loads(capsys.readouterr().out)["warnings"])
