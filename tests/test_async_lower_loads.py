"""A hit that reaches NVMe loads asynchronously on the device path (issue 36 item 3): the scheduler
marks it (`SchedulerOptions.async_lower_loads`, on for a device), so vLLM keeps the request in
WAITING_FOR_REMOTE_KVS and its reads never delay the step's forward: `start_load` queues nothing
for it and reads nothing; `poll_async` (after the forward's launch) reads the blocks and queues
their copies, the compute stream's later work waiting for them and the host not; the request is
reported received and its blocks are the stored bytes. Without the option the reads run in
`start_load`, before the forward. The device runs on CPU through `probes.DeferredStreams`."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from kvtier.connector.worker import KVTierWorker
from kvtier.policies import EVICTION
from kvtier.tiers.base import SlotTier
from kvtier.tiers.nvme_control import NvmeControl

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"))
import probes  # noqa: E402
from parts_util import scheduler, worker_settings  # noqa: E402
from test_connector_nvme import H, D2, caches  # noqa: E402
from test_connector_scheduler import BT, Req  # noqa: E402


class Syncs(probes.DeferredStreams):
    """Counts the host's waits on the side stream."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs = 0

    def sync(self, event):
        self.syncs += 1
        super().sync(event)


def sched(path, **options):
    bb = 2 * H * BT * D2 * 4
    cpu = SlotTier("cpu", 8, bb, EVICTION.get("lru")(8))
    nv = NvmeControl("nvme", str(path), 16, bb, EVICTION.get("lru")(16), {"model": "t"})
    return scheduler([cpu, nv], BT, **options), cpu, nv


def worker(seed):
    st = Syncs()
    w = KVTierWorker(worker_settings(8, nvme_direct="auto", nvme_write_lag_steps=0), copy_streams=st)
    c = caches(seed)
    w.register_kv_caches(c)
    return w, c, st


def stored_on_nvme(d) -> list[torch.Tensor]:
    """4 blocks computed, stored to DRAM and written through to NVMe; their canonical bytes."""
    s, cpu, nv = sched(d)
    w, c, st = worker(0)
    r = Req("a", list(range(4 * BT + 3)))
    ids = [1, 2, 3, 4, 5]
    s.lookup(r, 0)
    s.on_alloc(r, [ids], 0)
    w.bind(s.build_meta([("a", r.num_tokens, [ids])]))
    w.start_load()
    w.save()
    st.drain()
    s.on_worker_meta(w.take_report())
    for _ in range(3):    # the device's store reported, then the NVMe write
        w.bind(s.build_meta([]))
        w.start_load()
        w.save()
        st.drain()
        s.on_worker_meta(w.take_report())
    assert len(nv.index) == 4
    want = [torch.cat([c[n][b].reshape(-1).view(torch.uint8) for n in c]) for b in ids[:4]]
    s.close()
    w.close()
    return want


@pytest.mark.parametrize("async_lower", [True, False])
def test_an_nvme_hit_loads_after_the_forward_is_launched(tmp_path, monkeypatch, async_lower):
    d = tmp_path / "nvme"
    want = stored_on_nvme(d)
    s, cpu, nv = sched(d, async_lower_loads=async_lower)      # a restart: DRAM empty, NVMe indexed
    w, c, st = worker(1)
    r = Req("b", list(range(4 * BT + 3)))
    assert s.lookup(r, 0) == 4 * BT
    assert s.loads_async("b") is async_lower
    dst = [9, 10, 11, 12, 13]
    s.on_alloc(r, [dst], 4 * BT)
    meta = s.build_meta([] if async_lower else [("b", r.num_tokens, [dst])])
    assert meta.async_loads == (["b"] if async_lower else [])
    w.bind(meta)
    reads = []
    real = w.nvme.read
    monkeypatch.setattr(w.nvme, "read", lambda slots, *a, **k: (reads.append(len(slots)), real(slots, *a, **k))[1])
    q0 = len(st.q["side"])
    w.start_load()                                             # before the forward
    read_before, queued_before = sum(reads), len(st.q["side"]) - q0
    for name in c:
        w.wait_layer(name)
    w.save()
    s0, w0 = st.syncs, len(st.waited)
    done = w.poll_async()                                      # after the forward's launch
    if async_lower:
        assert (read_before, queued_before) == (0, 0)          # nothing read, nothing queued before the forward
        assert done == {"b"} and sum(reads) == 4 and w.totals["blocks_loaded.nvme"] == 4
        assert st.syncs == s0 and len(st.waited) == w0 + 1    # queued: the compute stream waits, the host does not
    else:
        assert read_before == 4 and queued_before > 0 and done == set()
    st.drain()
    s.on_worker_meta(w.take_report())
    got = [torch.cat([c[n][b].reshape(-1).view(torch.uint8) for n in c]) for b in dst[:4]]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert w.take_load_errors() == set()
    s.on_finished("b")
    assert s.pinned_blocks() == 0
    s.close()
    w.close()


def test_a_dram_hit_stays_in_the_step(tmp_path):
    """A hit DRAM serves whole is no asynchronous load, with the option on."""
    d = tmp_path / "nvme"
    s, cpu, nv = sched(d, async_lower_loads=True)
    w, c, st = worker(0)
    r = Req("a", list(range(4 * BT + 3)))
    s.lookup(r, 0)
    s.on_alloc(r, [[1, 2, 3, 4, 5]], 0)
    w.bind(s.build_meta([("a", r.num_tokens, [[1, 2, 3, 4, 5]])]))
    w.start_load()
    w.save()
    st.drain()
    s.on_worker_meta(w.take_report())
    assert s.lookup(Req("b", r.tokens), 0) == 4 * BT and cpu.num_resident == 4
    assert s.loads_async("b") is False
    s.close()
    w.close()
