"""One control plane: the same trace and YAML through `kvtier replay` and through the connector's
scheduler side under a fake vLLM step loop give identical per-tier counts (both drive the same
TierController; this checks that neither adapter adds a decision of its own)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from kvtier.cli import main
from kvtier.core.builder import build_controller, build_tiers
from kvtier.core.config import load_config
from kvtier.connector.metadata import KVTierWorkerMeta
from kvtier.connector.scheduler import KVTierScheduler
from kvtier.core.keys import GROUP_ID_BYTES
from kvtier.offline.trace import make_keys
from kvtier.offline.trace import load_trace

BT = 512
COUNTS = ("hit_blocks", "stored_blocks", "evicted_blocks", "demoted_blocks", "promoted_blocks",
          "not_admitted_blocks", "store_dropped_blocks")


@dataclass
class FakeRequest:
    """What vLLM's Request shows the connector: hashes of its full blocks only."""

    request_id: str
    block_hashes: list[bytes]
    num_tokens: int
    arrival_time: float


def fake_vllm(cfg_path: str, reqs) -> dict:
    """Each request alone in its steps, as vLLM runs it: lookup, allocate (accepting every
    matched token), one step that computes every block, the workers' report (all ok), finish."""
    cfg = load_config(cfg_path).model_copy(update={"block_tokens": BT})
    s = KVTierScheduler(build_controller(cfg, build_tiers(cfg, "none")))
    for i, (r, keys) in enumerate(zip(reqs, make_keys(reqs))):
        full = min(len(keys), r.input_length // BT)
        req = FakeRequest(f"r{i}", [k[:-GROUP_ID_BYTES] for k in keys[:full]], r.input_length, r.timestamp / 1000.0)
        ids = list(range(len(keys) + 1))
        n = s.lookup(req, 0)
        s.on_alloc(req, [ids], n)
        meta = s.build_meta([(req.request_id, req.num_tokens, [ids])])
        wm = KVTierWorkerMeta(stored={op.op_id: [True] * len(op.slots) for op in meta.stores},
                              loaded={op.req_id: True for op in meta.loads})
        for op in meta.loads:
            if op.via:
                wm.stored[op.op_id] = [True] * len(op.slots)
        wm.copied = {op.op_id: [0] * len(op.src_slots) for op in meta.copies}
        s.on_worker_meta(wm)
        s.on_finished(req.request_id)
    out = {c: {t.name: int(s.ctrl.totals.get(f"{c}.{t.name}", 0)) for t in s.tiers} for c in COUNTS}
    s.close()
    return out


@pytest.mark.parametrize("policy", [
    "{eviction: lru, promotion: inclusive, demotion: write_through}",
    "{eviction: lru, promotion: exclusive, demotion: write_back}",
    "{eviction: lru, promotion: inclusive, demotion: write_back, admission: second_hit}",
    "{eviction: arc, promotion: inclusive, demotion: write_through}",
    "{eviction: s3fifo, promotion: exclusive, demotion: write_back}",
])
def test_replay_equals_connector_scheduler(tmp_path, capsys, trace_path, policy):
    _check_equal(tmp_path, capsys, trace_path, policy, "")


def test_replay_equals_connector_scheduler_with_a_shared_tier(tmp_path, capsys, trace_path):
    """The shared tier as replay models it (an LRU of its capacity): the same decisions both ways."""
    shared = "  - {name: shared, kind: redis, capacity_blocks: 1536, admission: second_hit}\n"
    d = _check_equal(tmp_path, capsys, trace_path, "{eviction: lru, promotion: inclusive, demotion: write_back}",
                     shared)
    sh = next(t for t in d["per_tier"] if t["name"] == "shared")
    assert sh["hit_blocks"] > 0 and sh["stored"] > 0 and sh["not_admitted"] > 0


def _check_equal(tmp_path, capsys, trace_path, policy: str, extra_tiers: str) -> dict:
    cfg = tmp_path / "stack.yaml"
    cfg.write_text(f"""
block_bytes: 256KiB
tiers:
  - {{name: cpu, kind: cpu, capacity_blocks: 64}}
  - {{name: nvme, kind: nvme, path: {tmp_path}/nvme, capacity_blocks: 1024}}
{extra_tiers}policy: {policy}
""")
    limit = 1500
    assert main(["replay", "--trace", str(trace_path), "--config", str(cfg), "--limit", str(limit),
                     "--no-data", "--no-belady", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    name = {"hit_blocks": "hit_blocks", "stored_blocks": "stored", "evicted_blocks": "evicted",
            "demoted_blocks": "demoted_in", "promoted_blocks": "promoted_in", "not_admitted_blocks": "not_admitted",
            "store_dropped_blocks": "dropped"}
    replayed = {c: {t["name"]: t[name[c]] for t in d["per_tier"]} for c in COUNTS}
    served = fake_vllm(str(cfg), load_trace(trace_path, limit=limit))
    assert served == replayed
    # not vacuous: both tiers served hits, blocks moved down and up
    assert all(replayed["hit_blocks"].values()) and replayed["demoted_blocks"]["nvme"] > 0
    assert replayed["promoted_blocks"]["cpu"] > 0
    return d
