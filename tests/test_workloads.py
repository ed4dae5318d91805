"""kvtier.offline.workloads: deterministic, Mooncake-valid, and each shape has its documented shape."""

import json

import pytest

from kvtier.offline.trace import load_trace, parse_request
from kvtier.offline.workloads import SHAPES, generate, stats, write_trace


def small(shape, seed=0, **kw):
    sizes = {"agent": {"sessions": 4}, "chat": {"conversations": 200}, "rag": {"requests": 300},
             "api": {"requests": 400}, "mix": {"scale": 0.05},
             "tenants": {"steady_requests": 200, "burst_requests": 200}}
    return generate(shape, seed, **{**sizes[shape], **kw})


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_deterministic_and_seeded(shape):
    a, b, c = small(shape, 3), small(shape, 3), small(shape, 4)
    assert a == b
    assert a != c


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_mooncake_format_roundtrip_and_chaining(tmp_path, shape):
    reqs = small(shape)
    p = tmp_path / f"{shape}.jsonl.gz"
    assert write_trace(reqs, p) == len(reqs)
    back = load_trace(p)
    assert [r.hash_ids for r in back] == [r.hash_ids for r in reqs]
    assert [r.tenant for r in back] == [r.tenant for r in reqs]
    ts = [r.timestamp for r in back]
    assert ts == sorted(ts)
    parent = {}
    for r in back:
        assert len(r.hash_ids) == -(-r.input_length // 512)   # ceil(tokens / block)
        for j, h in enumerate(r.hash_ids):       # chained: a block id always has the same parent
            prev = r.hash_ids[j - 1] if j else None
            assert parent.setdefault(h, prev) == prev
    parse_request(json.loads(json.dumps({"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0]})))


def test_block_tokens_option():
    reqs = generate("chat", 0, block_tokens=64, conversations=50)
    assert all(len(r.hash_ids) == -(-r.input_length // 64) for r in reqs)


def test_agent_shape():
    reqs = small("agent")
    s = stats(reqs)
    assert s["max_input_tokens"] >= 100_000              # sessions grow to 100k+ tokens
    assert s["reuse_ratio"] > 0.8                        # each step re-sends the context
    # sub-agents: requests on the shared sub-agent prompt (4000 tokens) as well as the 12k agent prompts
    firsts = {r.hash_ids[0] for r in reqs}
    assert len(firsts) >= 2


def test_chat_shape():
    reqs = small("chat")
    s = stats(reqs)
    assert 1.5 < s["requests"] / 200 < 8                 # geometric turns, mean 4
    assert s["mean_input_tokens"] < 20_000 and s["reuse_ratio"] > 0.4


def test_rag_and_api_share_prefixes():
    rag = small("rag")
    assert len({r.hash_ids[0] for r in rag}) == 1        # one shared system prompt
    assert len({r.hash_ids[:3] for r in rag}) < len(rag) // 2   # popular first documents recur
    api = small("api")
    assert all(r.output_length >= 1 for r in api)
    assert len({r.hash_ids[0] for r in api}) < len(api) // 3    # a few popular applications


def test_unknown_shape():
    with pytest.raises(ValueError):
        generate("nope")


def test_cli_workload(tmp_path, capsys):
    from kvtier.cli.main import main
    out = tmp_path / "w.jsonl"
    assert main(["workload", "api", "--seed", "2", "-o", str(out)]) == 0
    assert len(load_trace(out)) == 20000
