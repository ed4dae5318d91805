"""A load that fails anywhere on its path is a load error for exactly its request's blocks and
taints the step's stores (issue 29, items 1, 3, 4): queuing its copies (CPU and device copier),
NVMe reads, the forward's layer wait; in vLLM's V2 hook order and in the V1 model runner's
(errors and the worker report taken before the deferred `wait_for_save`). Driven through the
connector's own hooks (their guard included) on CPU tensors; the device copier with a fake
`Streams` whose calls are recorded."""

from __future__ import annotations

import logging
import os
import sys

import pytest
import torch

from kvtier.connector.metadata import KVTierMetadata, LoadOp, StoreOp
from kvtier.connector.worker import KVTierWorker
from kvtier.tiers import io_engine as io_hooks

sys.path.insert(0, os.path.dirname(__file__))
from parts_util import worker_settings  # noqa: E402
from test_kv_layout import flash_caches  # noqa: E402


class RecordingStreams:
    """`device_copy.Streams` on CPU tensors: runs each copy at once and records the stream calls
    in order (events are numbers), so a test sees what the host waited for and when."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.n = 0

    def fence(self):
        self.calls.append(("fence",))

    def side(self):
        rec = self

        class _Side:
            def __enter__(self):
                rec.calls.append(("side",))

            def __exit__(self, *a):
                rec.calls.append(("main",))
        return _Side()

    def run(self, fn, *args):
        fn(*args)

    def record(self):
        self.n += 1
        self.calls.append(("record", self.n))
        return self.n

    def compute_wait(self, ev):
        self.calls.append(("compute_wait", ev))

    def sync(self, ev):
        self.calls.append(("sync", ev))

    def query(self, ev):      # every copy ran at once
        return True

C = pytest.importorskip("kvtier.connector.connector")

NB = 12


class Hooks(C.KVTierConnector):
    """The worker-side hooks of `KVTierConnector` exactly as vLLM calls them (the same functions,
    guard included) around one `KVTierWorker`, without a vLLM config."""

    def __init__(self, worker: KVTierWorker) -> None:
        self.worker, self.sched, self.hybrid = worker, None, False

    def step(self, meta: KVTierMetadata, layers: list[str], v1: bool = False) -> tuple[set, object]:
        """One step: bind, load, the forward's layer waits, then the V2 order (save, errors,
        report) or the V1 model runner's with speculative decoding (errors, report, save)."""
        self.worker.bind(meta)
        self.start_load_kv(None)
        for name in layers:
            self.wait_for_layer_load(name)
        if not v1:
            self.wait_for_save()
        errors = self.get_block_ids_with_load_errors()
        report = self.build_connector_worker_meta()
        if v1:
            self.wait_for_save()
        self.worker.bind(None)
        return errors, report


def worker(caches, streams=None, slots=16) -> KVTierWorker:
    w = KVTierWorker(worker_settings(slots), copy_streams=streams)
    w.register_kv_caches(caches)
    return w


def poison_copies_of(monkeypatch, w: KVTierWorker, block: int):
    """The KV copier rejects any copy into `block` (as a driver rejects a copy): the whole batch
    it is in fails; alone, only its own."""
    made: dict[int, list[int]] = {}
    real_job, real_run = w.kv.job, w.kv.run

    def job(host, block_ids, rows, bufs):
        j = real_job(host, block_ids, rows, bufs)
        made[id(j)] = list(block_ids)
        return j

    def run(jobs, to_outside):
        if to_outside and any(block in made.get(id(j), ()) for j in jobs):
            raise RuntimeError("copy rejected by the driver")
        real_run(jobs, to_outside)
    monkeypatch.setattr(w.kv, "job", job)
    monkeypatch.setattr(w.kv, "run", run)


@pytest.mark.parametrize("v1", [False, True], ids=["v2-order", "v1-order"])
def test_failed_copy_is_a_load_error_of_its_request_only_and_taints_the_step(monkeypatch, v1):
    caches = flash_caches(blocks=NB)
    w = worker(caches)
    h = Hooks(w)
    h.step(KVTierMetadata(stores=[StoreOp(1, 0, [0, 1, 2, 3, 4], [1, 2, 3, 4, 5])]), [])
    orig = {n: t.clone() for n, t in caches.items()}
    for t in caches.values():
        t[6:11].zero_()
    poison_copies_of(monkeypatch, w, 9)
    meta = KVTierMetadata(loads=[LoadOp("a", 0, [0, 1], [6, 7]), LoadOp("b", 0, [2, 3, 4], [8, 9, 10])],
                          stores=[StoreOp(2, 0, [5, 6], [0, 11])])
    errors, report = h.step(meta, list(caches), v1=v1)
    assert errors == {8, 9, 10}                      # exactly b's blocks: vLLM recomputes them
    assert report.loaded == {"a": True, "b": False}
    if v1:  # the stores ran after the report: they are in the next one
        report = h.build_connector_worker_meta()
    assert report.stored == {2: [False, False]}      # the step read b's blocks: nothing it computed is stored
    for n, t in caches.items():
        assert torch.equal(t[6:8], orig[n][1:3])     # a's blocks are in place
    assert w.totals["blocks_loaded.cpu"] == 2 and w.totals["blocks_load_failed.cpu"] == 3
    assert w.totals["load_copy_failed"] == 1
    # the next step is not tainted (whatever order the hooks ran in)
    errors, report = h.step(KVTierMetadata(stores=[StoreOp(3, 0, [7], [0])]), [], v1=v1)
    report = h.build_connector_worker_meta() if v1 else report
    assert not errors and report.stored == {3: [True]}
    w.close()


@pytest.mark.parametrize("v1", [False, True], ids=["v2-order", "v1-order"])
def test_load_errors_taken_before_the_deferred_save_still_taint_it(v1, monkeypatch):
    """vLLM's V1 model runner with speculative decoding takes the load errors and the worker
    report, runs the drafter, then calls `wait_for_save`: the step's failed load still drops its
    stores (it used to be forgotten once the errors were taken)."""
    w = worker(flash_caches(blocks=NB))
    h = Hooks(w)
    h.step(KVTierMetadata(stores=[StoreOp(1, 0, [0, 1], [1, 2])]), [])
    monkeypatch.setattr(io_hooks.HOOKS, "counts", {})
    monkeypatch.setattr(io_hooks.HOOKS, "fault", ("load_copy", "error", 1))   # every load fails
    errors, report = h.step(KVTierMetadata(loads=[LoadOp("r", 0, [0, 1], [6, 7])],
                                           stores=[StoreOp(2, 0, [4], [0])]), [], v1=v1)
    assert errors == {6, 7} and report.loaded == {"r": False}
    report = h.build_connector_worker_meta() if v1 else report
    assert report.stored == {2: [False]}
    monkeypatch.setattr(io_hooks.HOOKS, "fault", None)
    errors, report = h.step(KVTierMetadata(stores=[StoreOp(3, 0, [5], [0])]), [], v1=v1)
    report = h.build_connector_worker_meta() if v1 else report
    assert not errors and report.stored == {3: [True]}
    w.close()


def test_a_step_load_failure_taints_even_when_an_asynchronous_load_lands_first(monkeypatch):
    """V1 order: `get_transfer_results` copies an asynchronous load in (after the forward) before
    `wait_for_save`; the step's own failed load, accounted on the way, still taints its stores,
    and the asynchronous request's blocks load."""
    w = worker(flash_caches(blocks=NB))
    h = Hooks(w)
    h.get_transfer_results = lambda: C.KVTierConnector.get_transfer_results(h, set())
    h.step(KVTierMetadata(stores=[StoreOp(1, 0, [0, 1, 2], [1, 2, 3])]), [])
    poison_copies_of(monkeypatch, w, 6)
    meta = KVTierMetadata(loads=[LoadOp("sync", 0, [0], [6]), LoadOp("later", 0, [1, 2], [8, 9])],
                          async_loads=["later"], stores=[StoreOp(2, 0, [4], [0])])
    w.bind(meta)
    h.start_load_kv(None)
    for name in w.layout.names:
        h.wait_for_layer_load(name)
    out = h.get_transfer_results()
    assert out.finished_recving == {"later"}
    assert h.get_block_ids_with_load_errors() == {6}
    report = h.build_connector_worker_meta()
    assert report.loaded == {"sync": False, "later": True}
    h.wait_for_save()
    assert h.build_connector_worker_meta().stored == {2: [False]}
    w.close()


@pytest.mark.parametrize("v1", [False, True], ids=["v2-order", "v1-order"])
def test_injected_load_copy_fault_fails_every_load_from_the_nth(monkeypatch, caplog, v1):
    caches = flash_caches(blocks=NB)
    w = worker(caches)
    h = Hooks(w)
    h.step(KVTierMetadata(stores=[StoreOp(1, 0, [0, 1], [1, 2])]), [])
    monkeypatch.setattr(io_hooks.HOOKS, "counts", {})
    monkeypatch.setattr(io_hooks.HOOKS, "fault", ("load_copy", "error", 2))
    load = lambda rid: KVTierMetadata(loads=[LoadOp(rid, 0, [0, 1], [6, 7])],   # noqa: E731
                                      stores=[StoreOp(9, 0, [4], [0])])
    errors, _ = h.step(load("r1"), list(caches), v1=v1)                # pass 1 of load_copy: fine
    assert not errors
    with caplog.at_level(logging.WARNING, logger="kvtier.faults"):
        errors, report = h.step(load("r2"), list(caches), v1=v1)       # pass 2 (the batch) and 3 (retry)
    assert errors == {6, 7} and report.loaded == {"r2": False}
    report = h.build_connector_worker_meta() if v1 else report
    assert report.stored == {9: [False]}
    lines = [r.getMessage() for r in caplog.records if r.name == "kvtier.faults"]
    assert len(lines) == 2 and all("injected fault at load_copy" in m for m in lines)
    w.close()


def test_store_copy_fault_drops_the_stores(monkeypatch, caplog):
    w = worker(flash_caches(blocks=NB))
    h = Hooks(w)
    monkeypatch.setattr(io_hooks.HOOKS, "counts", {})
    monkeypatch.setattr(io_hooks.HOOKS, "fault", ("store_copy", "error", 1))
    with caplog.at_level(logging.WARNING, logger="kvtier.faults"):
        errors, report = h.step(KVTierMetadata(stores=[StoreOp(1, 0, [0, 1], [1, 2])]), [])
    assert not errors and report.stored == {1: [False, False]}       # never committed: future misses
    assert [r.getMessage().split(" (")[0] for r in caplog.records if r.name == "kvtier.faults"] == \
        ["kvtier: injected fault at store_copy"]
    assert "blocks_stored.cpu" not in w.totals
    w.close()


def test_staging_failure_in_the_device_copier_fails_only_its_request():
    """The device copier's staging buffer cannot be had for one request's copies (a CUDA OOM):
    the side stream is synchronised before the error goes on (no copy left running), that
    request's blocks are load errors, the other request's blocks load and its layers are waited
    for on the compute stream."""
    caches = flash_caches(blocks=NB)
    st = RecordingStreams()
    w = worker(caches, st)
    h = Hooks(w)
    h.step(KVTierMetadata(stores=[StoreOp(1, 0, [0, 1, 2, 3, 4], [1, 2, 3, 4, 5])]), [])
    orig = {n: t.clone() for n, t in caches.items()}
    dc = w.kv.device
    real = dc._stage

    def stage(n):
        if n >= 3:   # the batch's 5 blocks, then b's 3 on its retry; a's 2 fit
            raise torch.OutOfMemoryError("CUDA out of memory (staging)")
        return real(n)
    dc._stage = stage
    st.calls.clear()
    meta = KVTierMetadata(loads=[LoadOp("a", 0, [0, 1], [6, 7]), LoadOp("b", 0, [2, 3, 4], [8, 9, 10])],
                          stores=[StoreOp(2, 0, [5], [0])])
    errors, report = h.step(meta, list(caches))
    assert errors == {8, 9, 10} and report.loaded == {"a": True, "b": False}
    assert report.stored == {2: [False]}
    for n, t in caches.items():
        assert torch.equal(t[6:8], orig[n][1:3])
    # each failed device.load (the batch's and b's retry) waited for its side stream at once
    calls = st.calls
    fails = [i for i, c in enumerate(calls) if c[0] == "sync" and calls[i - 1] == ("record", c[1])]
    assert len(fails) >= 2
    waits = [c for c in calls if c[0] == "compute_wait"]
    assert len(waits) == len(caches)                 # every layer waited for on the compute stream
    w.close()


class FailingWait(RecordingStreams):
    """The compute stream cannot be made to wait (`compute_wait` raises); `sync` fails too when
    `sync_fails`."""

    def __init__(self, sync_fails=False):
        super().__init__()
        self.sync_fails = sync_fails

    def compute_wait(self, ev):
        self.calls.append(("compute_wait", ev))
        raise RuntimeError("CUDA error: invalid resource handle")

    def sync(self, ev):
        self.calls.append(("sync", ev))
        if self.sync_fails and self.calls[-2][0] == "compute_wait":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")


def _layer_wait_step(streams):
    caches = flash_caches(blocks=NB)
    w = worker(caches, streams)
    h = Hooks(w)
    h.step(KVTierMetadata(stores=[StoreOp(1, 0, [0, 1], [1, 2])]), [])
    streams.calls.clear()
    seen = []
    real = h.wait_for_layer_load

    def wait(name):          # what the forward's layer saw when the hook returned
        real(name)
        seen.append((name, list(streams.calls)))
    h.wait_for_layer_load = wait
    meta = KVTierMetadata(loads=[LoadOp("r", 0, [0, 1], [6, 7])], stores=[StoreOp(2, 0, [4], [0])])
    errors, report = h.step(meta, list(caches))
    return w, caches, errors, report, seen


def _last_load_event(calls):
    return max(c[1] for c in calls[:calls.index(("main",))] if c[0] == "record")


def test_layer_wait_that_fails_waits_on_the_host():
    st = FailingWait()
    w, caches, errors, report, seen = _layer_wait_step(st)
    last = _last_load_event(seen[0][1])
    # before the first layer's attention ran, the host waited for the load's last event
    assert ("sync", last) in seen[0][1]
    assert not errors and report.loaded == {"r": True} and report.stored == {2: [True]}
    assert w.totals["layer_wait_failed"] == 1        # later layers: nothing left to wait for
    assert w.totals["blocks_loaded.cpu"] == 2
    w.close()


def test_layer_wait_that_cannot_be_confirmed_fails_the_request():
    st = FailingWait(sync_fails=True)
    w, caches, errors, report, seen = _layer_wait_step(st)
    assert ("sync", _last_load_event(seen[0][1])) in seen[0][1]   # tried before the first layer ran
    assert errors == {6, 7} and report.loaded == {"r": False}
    assert report.stored == {2: [False]}             # computed over blocks not confirmed
    assert w.totals["blocks_load_failed.cpu"] == 2
    w.close()


def test_injected_layer_wait_fault_logs_and_falls_back(monkeypatch, caplog):
    st = RecordingStreams()
    monkeypatch.setattr(io_hooks.HOOKS, "counts", {})
    monkeypatch.setattr(io_hooks.HOOKS, "fault", ("layer_wait", "error", 1))
    with caplog.at_level(logging.WARNING, logger="kvtier.faults"):
        w, caches, errors, report, seen = _layer_wait_step(st)
    last = _last_load_event(seen[0][1])
    assert ("sync", last) in seen[0][1] and not errors and report.loaded == {"r": True}
    assert [r.getMessage().split(" (")[0] for r in caplog.records if r.name == "kvtier.faults"] == \
        ["kvtier: injected fault at layer_wait"]
    w.close()


def test_nvme_read_fault_is_a_load_error(monkeypatch, tmp_path, caplog):
    from kvtier.connector.metadata import CopyOp
    from kvtier.tiers.nvme_control import NvmeControl
    from kvtier.policies.lru import LRU

    caches = flash_caches(blocks=NB)
    w = KVTierWorker(worker_settings(8, nvme_write_lag_steps=0, nvme_io="posix"))
    w.register_kv_caches(caches)
    h = Hooks(w)
    nv = dict(nvme_tier=1, nvme_dir=str(tmp_path / "nvme"), nvme_capacity=16)
    ctl = NvmeControl("nvme", nv["nvme_dir"], 16, w.layout.block_bytes, LRU(16))
    keys = [b"k%d" % i for i in range(3)]
    _, rep = h.step(KVTierMetadata(stores=[StoreOp(1, 0, [0, 1, 2], [1, 2, 3])],
                                   copies=[CopyOp(2, [0, 1, 2], [10, 11, 12], keys)], **nv), [])
    sums = rep.copied[2]
    assert min(sums) >= 0
    monkeypatch.setattr(io_hooks.HOOKS, "counts", {})
    monkeypatch.setattr(io_hooks.HOOKS, "fault", ("read", "EIO", 1))
    meta = KVTierMetadata(loads=[LoadOp("r", 1, [10, 11, 12], [6, 7, 8], sums, keys=keys),
                                 LoadOp("d", 0, [0], [9])], stores=[StoreOp(3, 0, [5], [0])], **nv)
    with caplog.at_level(logging.WARNING, logger="kvtier.faults"):
        errors, report = h.step(meta, list(caches))
    assert errors == {6, 7, 8} and report.loaded == {"r": False, "d": True}
    assert report.stored == {3: [False]}
    assert any("injected fault at read" in r.getMessage() for r in caplog.records)
    assert w.totals["blocks_load_failed.nvme"] == 3 and w.totals["blocks_loaded.cpu"] == 1
    w.close()
    ctl.close()


def test_fault_spec_names_a_known_point(monkeypatch):
    monkeypatch.setenv("KVTIER_FAULT", "load_copies:error:1")
    with pytest.raises(ValueError, match="not one of"):
        io_hooks._Hooks()


def test_a_failed_store_is_not_written_down(monkeypatch, tmp_path):
    """A store that failed leaves its DRAM slots stale: the step's copy down from them writes
    nothing to the data file (the index would not take it, but `fsck --rebuild` reads headers)."""
    from kvtier.connector.metadata import CopyOp
    from kvtier.tiers.nvme_control import NvmeControl
    from kvtier.policies.lru import LRU
    from kvtier.tiers.nvme_block import slot_stride

    w = KVTierWorker(worker_settings(8, nvme_write_lag_steps=0, nvme_io="posix"))
    w.register_kv_caches(flash_caches(blocks=NB))
    h = Hooks(w)
    nv = dict(nvme_tier=1, nvme_dir=str(tmp_path / "nvme"), nvme_capacity=16)
    ctl = NvmeControl("nvme", nv["nvme_dir"], 16, w.layout.block_bytes, LRU(16))
    monkeypatch.setattr(io_hooks.HOOKS, "counts", {})
    monkeypatch.setattr(io_hooks.HOOKS, "fault", ("store_copy", "error", 1))
    _, rep = h.step(KVTierMetadata(stores=[StoreOp(1, 0, [0, 1], [1, 2])],
                                   copies=[CopyOp(2, [0, 1], [3, 4], [b"k0", b"k1"])], **nv), [])
    assert rep.stored == {1: [False, False]} and rep.copied == {2: [-1, -1]}
    stride = slot_stride(w.layout.block_bytes)
    with open(w.nvme.path, "rb") as f:
        f.seek(3 * stride)
        assert not any(f.read(2 * stride))           # slots 3 and 4: never written
    w.close()
    ctl.close()
