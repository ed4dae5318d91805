"""No host wait in a step's hooks (issue 29, item 5), on CPU with `probes.DeferredStreams`, a fake
whose copies run only when something lets them (as a GPU's run later): a store is reported
stored, and its copy down written and checksummed, only in a step after its event completed; the
hooks never wait on the host; a store whose copy fails, or is still copying at shutdown, commits
nothing; every host range a copy touches (rows and block indices) lies inside one registration.
Driven through the connector's own hooks (`test_load_failures.Hooks`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from kvtier.connector.kv_layout import KVLayout
from kvtier.connector.metadata import CopyOp, KVTierMetadata, LoadOp, StoreOp
from kvtier.connector.worker import KVTierWorker
from kvtier.tiers import cpu_pool

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"))
import probes  # noqa: E402
from test_kv_layout import flash_caches  # noqa: E402
from parts_util import worker_settings  # noqa: E402
from test_load_failures import Hooks  # noqa: E402

NB = 12


class CountingStreams(probes.DeferredStreams):
    """DeferredStreams that counts the host's waits (`sync`)."""

    def __init__(self, prefer: str = "side") -> None:
        super().__init__(prefer)
        self.syncs = 0

    def sync(self, event):
        self.syncs += 1
        super().sync(event)


def canonical_rows(caches, blocks):
    return [torch.cat([probes.canonical(t, b) for t in caches.values()]) for b in blocks]


def nvme_rig(tmp_path, streams, caches):
    """A worker of 8 unpinned DRAM slots over `caches` copying on `streams`, its hooks, the
    metadata fields that name its NVMe tier, and that tier's control plane."""
    from kvtier.tiers.nvme_control import NvmeControl
    from kvtier.policies.lru import LRU

    w = KVTierWorker(worker_settings(8, pin=False, nvme_write_lag_steps=0, nvme_io="posix"), copy_streams=streams)
    w.register_kv_caches(caches)
    nv = dict(nvme_tier=1, nvme_dir=str(tmp_path / "nvme"), nvme_capacity=16)
    return w, Hooks(w), nv, NvmeControl("nvme", nv["nvme_dir"], 16, w.layout.block_bytes, LRU(16))


def test_a_store_is_reported_and_written_down_only_after_its_copy_ran(tmp_path):
    """Step 1 queues the store and its NVMe copy; the copies have not run, so step 1 reports
    neither and the data file is untouched. Once the device ran them, the next step's poll reports
    the store, then writes and checksums the CPU slots: loaded back through those checksums, the
    blocks are the source's bytes."""
    from kvtier.tiers.nvme_block import slot_stride

    caches = flash_caches(blocks=NB)
    orig = {n: t.clone() for n, t in caches.items()}
    st = CountingStreams()
    w, h, nv, ctl = nvme_rig(tmp_path, st, caches)
    keys = [b"k0", b"k1", b"k2"]
    _, rep = h.step(KVTierMetadata(stores=[StoreOp(1, 0, [0, 1, 2], [1, 2, 3])],
                                   copies=[CopyOp(2, [0, 1, 2], [10, 11, 12], keys)], **nv), [])
    assert rep is None or (not rep.stored and not rep.copied)
    rows = w.pools[0].buffer.view(8, -1)
    assert not rows[:3].any()                        # the copy has not run: the slots are untouched
    stride = slot_stride(w.layout.block_bytes)
    with open(w.nvme.path, "rb") as f:
        f.seek(10 * stride)
        assert not any(f.read(3 * stride))           # nothing written down before the event
    _, rep = h.step(KVTierMetadata(**nv), [])        # the device has not run it yet: still pending
    assert rep is None or (not rep.stored and not rep.copied)
    st.drain()                                       # the device runs the copies
    _, rep = h.step(KVTierMetadata(**nv), [])
    assert rep.stored == {1: [True] * 3}
    sums = rep.copied[2]
    assert len(sums) == 3 and min(sums) >= 0
    for r, want in zip(rows[:3], canonical_rows(orig, [1, 2, 3])):
        assert torch.equal(r, want)
    for t in caches.values():
        t.zero_()
    errors, rep = h.step(KVTierMetadata(loads=[LoadOp("r", 1, [10, 11, 12], [6, 7, 8], sums, keys=keys)], **nv),
                         list(caches))
    st.drain()
    assert not errors and rep.loaded == {"r": True}
    for n, t in caches.items():
        assert torch.equal(t[6:9], orig[n][1:4])
    assert st.syncs == 0                             # no hook waited on the host, in any step
    w.close()
    ctl.close()


@pytest.mark.parametrize("v1", [False, True], ids=["v2-order", "v1-order"])
def test_the_hooks_never_wait_on_the_host(v1):
    """Steps with layered loads and stores, the device progressing between steps as a GPU does:
    `sync` is never called by start_load_kv, wait_for_layer_load, wait_for_save,
    get_block_ids_with_load_errors or build_connector_worker_meta; every store is reported once,
    in a later step than its own, with the source's bytes."""
    caches = flash_caches(blocks=NB)
    st = CountingStreams()
    w = KVTierWorker(worker_settings(16, pin=False), copy_streams=st)
    w.register_kv_caches(caches)
    h = Hooks(w)
    want = {}
    seen: dict[int, int] = {}
    for step in range(6):
        slots = [2 * step, 2 * step + 1]
        blocks = [(step + 1) % NB, (step + 5) % NB]
        want[step + 1] = (slots, canonical_rows(caches, blocks))
        loads = [LoadOp(f"r{step}", 0, [0, 1], [10, 11])] if step else []
        errors, rep = h.step(KVTierMetadata(loads=loads, stores=[StoreOp(step + 1, 0, slots, blocks)]),
                             list(caches), v1=v1)
        assert not errors
        for op in (rep.stored if rep else {}):
            seen[op] = step
        assert step + 1 not in seen                  # never in the step that queued it
        st.drain()                                   # the device catches up before the next step
    _, rep = h.step(KVTierMetadata(), [])
    seen.update({op: 6 for op in rep.stored})
    assert st.syncs == 0
    assert sorted(seen) == list(range(1, 7)) and all(seen[op] == op for op in seen)
    rows = w.pools[0].buffer.view(16, -1)
    for slots, rws in want.values():
        for s, r in zip(slots, rws):
            assert torch.equal(rows[s], r)
    w.close()


class FailingQuery(probes.DeferredStreams):
    """The store's event reports a device error when polled."""

    def query(self, event):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_a_store_whose_copy_failed_commits_nothing(tmp_path):
    w, h, nv, ctl = nvme_rig(tmp_path, FailingQuery(), flash_caches(blocks=NB))
    _, rep = h.step(KVTierMetadata(stores=[StoreOp(1, 0, [0, 1], [1, 2])],
                                   copies=[CopyOp(2, [0, 1], [3, 4], [b"k0", b"k1"])], **nv), [])
    assert rep.stored == {1: [False, False]} and rep.copied == {2: [-1, -1]}
    assert w.totals["store_copy_failed"] == 1 and "blocks_stored.cpu" not in w.totals
    w.close()
    ctl.close()


def test_shutdown_drops_stores_still_copying():
    """A store whose copy never completes: close waits its bound, then reports it not stored,
    counts it, and leaves the pool mapped (the copy would still write it)."""
    w = KVTierWorker(worker_settings(8, pin=False), copy_streams=probes.DeferredStreams())
    w.register_kv_caches(flash_caches(blocks=NB))
    h = Hooks(w)
    h.step(KVTierMetadata(stores=[StoreOp(1, 0, [0, 1], [1, 2])]), [])
    final = w.close(timeout_s=0.05)
    assert final.stored == {1: [False, False]}
    assert w.totals["stores_dropped"] == 2
    assert w.pools                                   # not unmapped under a running copy


class Registry:
    """cudaHostRegister / cudaHostUnregister that only record what is registered."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}

    def register(self, ptr, size):
        self.registered[ptr] = size

    def unregister(self, ptr):
        self.registered.pop(ptr, None)


def test_every_host_range_a_copy_touches_lies_in_one_registration(monkeypatch):
    """The CPU pool registered in chunks of 4 rows: a store and a load whose rows run across a
    chunk's end are cut there; every host range copied (rows and the block indices' ring) lies
    inside one registration; the bytes round-trip exactly."""
    reg = Registry()
    monkeypatch.setattr(cpu_pool, "CUDA", reg)
    monkeypatch.setattr(cpu_pool, "cuda_available", lambda: True)
    caches = flash_caches(blocks=NB)
    orig = {n: t.clone() for n, t in caches.items()}
    st = probes.DeferredStreams()
    w = KVTierWorker(worker_settings(16, pin=True), copy_streams=st)
    row = KVLayout(caches).block_bytes
    monkeypatch.setattr(cpu_pool, "REGISTER_CHUNK_BYTES", 4 * row)
    w.register_kv_caches(caches)
    pool = w.pools[0]
    assert pool.pinned and len(pool.host.chunks) >= 4 and w.kv.device.index.buf.pinned
    trace = w.kv.device.traced()
    h = Hooks(w)
    slots, blocks = [2, 3, 4, 5, 6, 9], [1, 2, 3, 4, 5, 7]       # rows 2..6 cross the end of rows 0..3
    h.step(KVTierMetadata(stores=[StoreOp(1, 0, slots, blocks)]), [])
    st.drain()
    _, rep = h.step(KVTierMetadata(), [])
    assert rep.stored == {1: [True] * 6}
    for t in caches.values():
        t.zero_()
    h.step(KVTierMetadata(loads=[LoadOp("r", 0, slots, [0, 6, 7, 8, 9, 10])]), list(caches))
    st.drain()
    for n, t in caches.items():
        assert torch.equal(t[[0, 6, 7, 8, 9, 10]], orig[n][blocks])
    spans = sorted(reg.registered.items())
    inside = [any(p <= a and a + n <= p + size for p, size in spans) for a, n in trace]
    assert trace and all(inside), [t for t, ok in zip(trace, inside) if not ok]
    base = pool.rows.data_ptr()
    row_ranges = [(a - base) // row for a, n in trace if base <= a < base + 16 * row]
    ring = w.kv.device.ring.buf.tensor
    staged = [a for a, n in trace if ring.data_ptr() <= a < ring.data_ptr() + ring.numel()]
    index_ranges = [a for a, n in trace if not base <= a < base + 16 * row and a not in staged]
    assert sorted(row_ranges) == sorted([2, 4, 9] * 2)          # each way: rows 2-3 | 4-6 | 9
    assert len(index_ranges) == 2                                # the store's and the load's indices
    assert len(staged) == len(caches)                            # the load's bytes, staged layer by layer
    w.close()


def test_staging_rows_are_reused_only_after_the_copies_that_read_them(tmp_path):
    """Two steps of NVMe loads through the same staging rows, the device not running between them:
    the second step's reads overwrite the rows only after the first step's copies ran (the host
    waits there, once), so both steps' blocks are the stored bytes."""
    caches = flash_caches(blocks=NB)
    orig = {n: t.clone() for n, t in caches.items()}
    st = CountingStreams()
    w, h, nv, ctl = nvme_rig(tmp_path, st, caches)
    keys = [b"k0", b"k1", b"k2", b"k3"]
    h.step(KVTierMetadata(stores=[StoreOp(1, 0, [0, 1, 2, 3], [1, 2, 3, 4])],
                          copies=[CopyOp(2, [0, 1, 2, 3], [10, 11, 12, 13], keys)], **nv), [])
    st.drain()
    _, rep = h.step(KVTierMetadata(**nv), [])
    sums = rep.copied[2]
    for t in caches.values():
        t.zero_()
    h.step(KVTierMetadata(loads=[LoadOp("a", 1, [10, 11], [6, 7], sums[:2], keys=keys[:2])], **nv), list(caches))
    assert st.syncs == 0
    h.step(KVTierMetadata(loads=[LoadOp("b", 1, [12, 13], [8, 9], sums[2:], keys=keys[2:])], **nv), list(caches))
    syncs = st.syncs
    st.drain()
    for n, t in caches.items():
        assert torch.equal(t[6:10], orig[n][1:5])
    assert syncs == 1                                # before the reads reused the staging rows
    w.close()
    ctl.close()
