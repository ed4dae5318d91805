"""MLA under tensor parallelism (issue 29, item 6): every rank holds the same latent KV, so rank 0
alone writes the NVMe file (once, as vLLM does) and every rank loads from it. Unit level: the
scheduler and two workers of the connector exchange the step metadata and aggregated reports as
vLLM carries them (a TP = 2 MLA run in vLLM on CPU is not part of the suite)."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace as NS

import pytest
import torch

from kvtier.connector.parallel import replicated, shards, store_rank

sys.path.insert(0, os.path.dirname(__file__))
from parts_util import worker_settings  # noqa: E402
from test_connector_nvme import _ranks_step, caches, sched  # noqa: E402
from test_connector_scheduler import BT, Req  # noqa: E402


def cfg(mla=True, tp=2, pp=1, dcp=1):
    return NS(model_config=NS(use_mla=mla),
              parallel_config=NS(tensor_parallel_size=tp, pipeline_parallel_size=pp, world_size=tp * pp,
                                 decode_context_parallel_size=dcp, prefill_context_parallel_size=1))


@pytest.mark.parametrize("c,want", [(cfg(), True), (cfg(mla=False), False), (cfg(tp=1), False),
                                    (cfg(pp=2), False), (cfg(dcp=2), False)],
                         ids=["mla-tp2", "gqa-tp2", "mla-tp1", "mla-tp2-pp2", "mla-tp2-dcp2"])
def test_which_configs_replicate(c, want):
    assert replicated(c) is want
    # vLLM's own count of TP ranks holding identical KV, where it has one: all of them, or not
    assert replicated(c, NS(kv_tp_replicas=c.parallel_config.tensor_parallel_size)) is want
    assert replicated(c, NS(kv_tp_replicas=1)) is False
    ws = c.parallel_config.world_size
    assert shards(c) == (1 if want else ws)
    assert [store_rank(c, r) for r in range(ws)] == ([0] * ws if want else list(range(ws)))


def _workers(seed, c):
    from kvtier.connector.worker import KVTierWorker
    out = []
    for rank in range(2):
        w = KVTierWorker(worker_settings(8, nvme_write_lag_steps=0), rank=rank, ranks=2, store_rank=store_rank(c, rank))
        kv = caches(seed)     # the same latent KV on both ranks
        w.register_kv_caches(kv)
        out.append((w, kv))
    return out


def test_mla_tp2_rank0_writes_every_rank_loads(tmp_path):
    c = cfg()
    d = tmp_path / "nvme"
    r = Req("a", list(range(4 * BT + 3)))
    ids = [1, 2, 3, 4, 5]
    s, cpu, nv = sched(d, ranks=shards(c))
    ws = _workers(0, c)
    s.lookup(r, 0)
    s.on_alloc(r, [ids], 0)
    _ranks_step(s, [w for w, _ in ws], [("a", r.num_tokens, ids)])
    # one copy on disk: rank 0's file, committed on rank 0's report alone; rank 1 wrote nothing
    assert sorted(f for f in os.listdir(d) if f.startswith("data.")) == ["data.0"]
    assert nv.num_resident == 4 and len(nv.index) == 4
    assert ws[0][0].totals["blocks_stored.nvme"] == 4 and "blocks_stored.nvme" not in ws[1][0].totals
    assert ws[0][0].totals["blocks_stored.cpu"] == ws[1][0].totals["blocks_stored.cpu"] == 4  # own DRAM pools
    want = [torch.cat([ws[0][1][n][b].reshape(-1).view(torch.uint8) for n in ws[0][1]]) for b in ids[:4]]
    s.close()
    for w, _ in ws:
        w.close()

    # restart: both ranks load every block from rank 0's file, byte-exact, nothing fails
    s, cpu, nv = sched(d, ranks=shards(c))
    ws = _workers(1, c)
    assert nv.restored_blocks == 4
    r2 = Req("b", r.tokens)
    assert s.lookup(r2, 0) == 4 * BT
    dst = [9, 10, 11, 12, 13]
    s.on_alloc(r2, [dst], 4 * BT)
    _ranks_step(s, [w for w, _ in ws], [("b", r2.num_tokens, dst)])
    for w, kv in ws:
        got = [torch.cat([kv[n][b].reshape(-1).view(torch.uint8) for n in kv]) for b in dst[:4]]
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert w.take_load_errors() == set() and w.corrupt_blocks == 0
        assert w.totals["blocks_loaded.nvme"] == 4
    assert sorted(f for f in os.listdir(d) if f.startswith("data.")) == ["data.0"]
    s.on_finished("b")
    assert s.pinned_blocks() == 0
    s.close()
    for w, _ in ws:
        w.close()
