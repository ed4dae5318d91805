"""A step's device copies are batched (issue 36, items 2 and 5), on CPU through
`probes.DeferredStreams` (copies run later, as a GPU's do; `count=True` counts each queued
item's launches): all requests' stores of a step, and all their loads, take the same kernels per
layer as one request's (only host<->device copies follow runs of rows); every layout round-trips
byte-exact with many requests and chunks crossing the staging size, each layer's reads on the
compute stream seeing its blocks; the index ring looks at its oldest copies only (O(1) per copy);
a store's scattered rows take one device->host copy (a bounce ring the host scatters from before
the store is reported); `benchmarks/gpu/launches.py --json` prints the figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvtier.common.counters import Metric
from kvtier.connector.device_copy import DeviceCopier, IndexRing
from kvtier.connector.kv_layout import KVLayout
from kvtier.connector.metadata import KVTierMetadata, LoadOp, StoreOp
from kvtier.connector.worker import KVTierWorker

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
import probes  # noqa: E402
from parts_util import worker_settings  # noqa: E402

LAYERS = 6


def counted_step(w: KVTierWorker, st: probes.DeferredStreams, loads, stores) -> tuple[int, int, int]:
    """One step's hooks; (load launches, store launches, events) once its copies ran."""
    st.drain()
    s0, e0 = len(st.q["side"]), st.events
    w.bind(KVTierMetadata(loads=loads, stores=stores))
    w.start_load()
    s1 = len(st.q["side"])
    w.save()
    s2 = len(st.q["side"])
    st.drain()
    w.take_report()
    n = st.item_launches["side"]
    return sum(n[s0:s1]), sum(n[s1:s2]), st.events - e0


@pytest.fixture
def counting_kv():
    st = probes.DeferredStreams(count=True)
    kv = probes.views("LBNHC", LAYERS, 80, 2, 16, 8, torch.bfloat16, "cpu")
    w = KVTierWorker(worker_settings(64), copy_streams=st)
    w.register_kv_caches(kv)
    yield w, st, kv
    w.close()


@pytest.fixture
def counting(counting_kv):
    yield counting_kv[:2]


def test_sixteen_requests_launch_what_one_does(counting):
    """16 one-block requests storing (slots 0..15) and 16 loading (slots 20..35) in one step: the
    same launches and events as 1 and 1 (before: 16 times the kernels, one event per layer and
    request). Rows apart (16 runs, more than the 6 layers): a store takes the same launches (one
    device->host copy into the bounce ring, scattered on the host; before: one copy per run, 15
    more); a load too (its rows are staged layer-major on the host: one host->device copy and one
    scatter per layer)."""
    w, st = counting
    one = counted_step(w, st, [LoadOp("a", 0, [20], [40])], [StoreOp(1, 0, [0], [1])])
    assert one == (2 * LAYERS + 1, 2 * LAYERS + 2, LAYERS + 3)   # + the indices' copy (+ one run of rows)
    many = counted_step(w, st, [LoadOp(f"l{i}", 0, [20 + i], [40 + i]) for i in range(16)],
                        [StoreOp(10 + i, 0, [i], [1 + i]) for i in range(16)])
    assert many == one
    apart = counted_step(w, st, [LoadOp(f"l{i}", 0, [2 * i], [40 + i]) for i in range(16)],
                         [StoreOp(10 + i, 0, [33 + 2 * i], [1 + i]) for i in range(16)])
    assert apart == one


def test_one_index_copy_per_direction_and_chunks_follow_bytes(counting):
    """40 blocks in chunks of 8 staging blocks: 5 chunks, the kernels per layer 5 times one chunk's,
    the indices copied once per direction."""
    w, st = counting
    w.kv.device.chunk = 8
    _, sv, _ = counted_step(w, st, [], [StoreOp(1 + i, 0, [4 * i + k for k in range(4)],
                                                [4 * i + k for k in range(4)]) for i in range(10)])
    ld, _, _ = counted_step(w, st, [LoadOp(f"l{i}", 0, [4 * i + k for k in range(4)],
                                           [40 + 4 * i + k for k in range(4)]) for i in range(10)], [])
    assert (ld, sv) == (5 * 2 * LAYERS + 1, 5 * 2 * LAYERS + 5 + 1)


CASES = [(lay, 1) for lay in probes.ORDERS] + [("LBNHC", 2), ("LHBNC", 2)]


@pytest.mark.parametrize("layout,ratio", CASES)
def test_many_requests_round_trip_byte_exact_layer_by_layer(layout, ratio):
    """Every layout (per-layer and cross-layer pages, 2-way kernel splits): 13 requests of 1-3
    blocks stored and loaded in one step each, rows in runs and apart, in chunks of 4 staging
    blocks (each crossing requests): the stored rows are the blocks' canonical bytes, and each
    layer's compute-stream reads after `wait_layer`, queued before any host sync, see the loaded
    blocks."""
    nb = 48
    kv = probes.views(layout, 3, nb, 2, 16, 8, torch.bfloat16, "cpu", ratio)
    g = torch.Generator().manual_seed(7)
    for t in kv.values():
        t.view(torch.uint8).copy_(torch.randint(0, 120, t.view(torch.uint8).shape, generator=g, dtype=torch.uint8))
    orig = {n: t.clone() for n, t in kv.items()}
    st = probes.DeferredStreams("compute")
    w = KVTierWorker(worker_settings(64), num_blocks=nb, copy_streams=st)
    w.register_kv_caches(kv)
    w.kv.device.chunk = 4
    sizes = [1, 3, 2, 1, 2, 3, 1, 1, 2, 3, 2, 1, 2]
    assert sum(sizes) == 24   # loaded into blocks 24..47
    apart = (30 + torch.randperm(34, generator=g)).tolist()
    stores, loads, b = [], [], 0
    for i, n in enumerate(sizes):
        slots = list(range(b, b + n)) if i % 2 else apart[b:b + n]      # runs of rows, rows apart
        stores.append(StoreOp(1 + i, 0, slots, list(range(b, b + n))))
        loads.append(LoadOp(f"r{i}", 0, slots, list(range(24 + b, 24 + b + n))))
        b += n
    w.bind(KVTierMetadata(stores=stores))
    w.save()
    st.drain()
    assert w.take_report().stored == {op.op_id: [True] * len(op.slots) for op in stores}
    rows = w.pools[0].buffer.view(64, -1)
    for op in stores:
        for blk, sl in zip(op.block_ids, op.slots):
            assert torch.equal(rows[sl], torch.cat([probes.canonical(t, blk, ratio) for t in orig.values()]))
    for t in kv.values():
        t[24 * ratio:].zero_()
    outs: dict[str, torch.Tensor] = {}
    w.bind(KVTierMetadata(loads=loads))
    w.start_load()
    for name, t in kv.items():
        w.wait_layer(name)
        st.compute(lambda n=name, t=t: outs.__setitem__(n, t[24 * ratio:].clone()))
    st.drain()
    assert w.take_report().loaded == {op.req_id: True for op in loads}
    for name in kv:
        assert torch.equal(outs[name], orig[name][:24 * ratio]), name
    w.close()


def test_parts_of_two_host_buffers_in_chunks_byte_exact():
    """A step's loads from two host buffers (DRAM slots, staging rows) and its stores to both, in
    chunks of 3 blocks that mix them: byte-exact both ways; one index copy per direction."""
    kv = probes.views("LBHNC", 4, 32, 2, 16, 8, torch.bfloat16, "cpu")
    for t in kv.values():
        t.normal_()
    orig = {n: t.clone() for n, t in kv.items()}
    lay = KVLayout(kv)
    st = probes.DeferredStreams("compute")
    dc = DeviceCopier(lay.canon, lay.offsets, st, staging_bytes=3 * lay.block_bytes, pin=False)
    trace = dc.traced()
    a = torch.zeros(10, lay.block_bytes, dtype=torch.uint8)
    c = torch.zeros(6, lay.block_bytes, dtype=torch.uint8)
    parts = [(a, [5, 1], [7, 2]), (c, [9, 3, 4], [0, 1, 2]), (a, [11], [3]), (c, [0], [5])]
    ev = dc.store_parts(parts)
    dc.sync(ev)
    for host, ids, rws in parts:
        for blk, r in zip(ids, rws):
            assert torch.equal(host[r], torch.cat([probes.canonical(t, blk) for t in orig.values()]))
    back = [(host, [b + 16 for b in ids], rws) for host, ids, rws in parts]
    events = dc.load_parts(back)
    assert len(events) == 4
    st.drain()
    for n, t in kv.items():
        for _, ids, _ in parts:
            for blk in ids:
                assert torch.equal(t[blk + 16], orig[n][blk])
    assert len([x for x in trace if x[1] == 7 * 8]) == 2     # the 7 indices, once each way
    dc.close()


class Queries(probes.DeferredStreams):
    def __init__(self) -> None:
        super().__init__()
        self.queries = self.syncs = 0

    def query(self, event):
        self.queries += 1
        return super().query(event)

    def sync(self, event):
        self.syncs += 1
        super().sync(event)


def test_the_index_ring_looks_at_its_oldest_copies_only():
    """3,000 index copies of 1-3 entries through a ring of 256, none run until the ring wraps onto
    them: each copy queries the events of the copies it overwrites and one more (before: every
    copy in flight, about a hundred), and every copy reads its own indices."""
    st = Queries()
    ring = IndexRing(st, torch.device("cpu"), pin=False, entries=256)
    most, outs = 0, []
    for i in range(3000):
        n = 1 + i % 3
        q0 = st.queries
        with st.side():
            outs.append((ring.to_device([i] * n), [i] * n))
        most = max(most, st.queries - q0)
    assert most <= 4 and st.queries <= 2 * 3000
    assert st.syncs > 0                      # the ring wrapped onto queued copies: the host waited
    st.drain()
    assert all(d.tolist() == want for d, want in outs)
    ring.close()


def test_launches_benchmark_prints_one_json_line():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "launches.py"), "--json", "--layers", "16"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1
    res = json.loads(lines[0])
    for k in ("layers", "store_launches_per_layer_1000_blocks", "load_launches_per_layer_1000_blocks",
              "launches_16_requests", "compute_waits_on_stores_per_step", "layer0_wait_fraction"):
        assert k in res, k
    assert res["layers"] == 16
    assert res["store_launches_per_layer_1000_blocks"] <= 4 and res["load_launches_per_layer_1000_blocks"] <= 4
    assert res["launches_16_requests"] == res["launches_1_request"] + 15    # 16 runs, 16 layers: a copy per run
    assert res["store_launches_per_layer_1000_blocks_scattered_rows"] <= 4
    assert res["load_launches_16_requests"] == res["load_launches_1_request"] == 2 * 16 + 1
    assert res["load_launches_per_layer_1000_blocks_scattered_rows"] <= 4
    assert res["layer0_wait_fraction"] <= 1 / 16 + 0.05
    assert res["events_16_requests"] == res["events_1_request"]


@pytest.mark.parametrize("layout", ["LBNHC", "BLHNC"])
def test_each_layers_event_follows_its_own_bytes_only(layout):
    """13 one-block loads, rows apart, from two host buffers in 4 chunks of the staging size: the
    bytes queued before layer i's event are the indices and layers 0..i's bytes (each layer's
    host->device copy and scatter), exactly; before, every layer's bytes of the first chunks (and
    of the last chunk's rows) came before layer 0's event. Byte-exact."""
    kv = probes.views(layout, LAYERS, 40, 2, 16, 8, torch.bfloat16, "cpu")
    for t in kv.values():
        t.normal_()
    lay = KVLayout(kv)
    bb, lb = lay.block_bytes, lay.layer_bytes[0]
    g = torch.Generator().manual_seed(3)
    a = torch.randint(0, 256, (30, bb), generator=g, dtype=torch.uint8)
    c = torch.randint(0, 256, (8, bb), generator=g, dtype=torch.uint8)
    parts = [(a, [i], [2 * i]) for i in range(9)] + [(c, [20 + i], [2 * i]) for i in range(4)]
    st = probes.DeferredStreams(count=True)
    dc = DeviceCopier(lay.canon, lay.offsets, st, staging_bytes=4 * bb, pin=False)
    events = dc.load_parts(parts)
    assert len(events) == LAYERS
    st.drain()
    b = st.item_bytes["side"]
    n = len(parts)
    assert [sum(b[:ev]) for ev in events] == [8 * n + 2 * (li + 1) * n * lb for li in range(LAYERS)]
    for host, ids, rows in parts:
        want = host[rows[0]]
        got = torch.cat([probes.canonical(t, ids[0]) for t in kv.values()])
        assert torch.equal(got, want)
    dc.close()


class DeviceRows(DeviceCopier):
    """Takes one rows buffer as the device's own memory (GPUDirect Storage's staging rows)."""

    def __init__(self, *a, device_rows: torch.Tensor, **k) -> None:
        super().__init__(*a, **k)
        self.device_rows = device_rows

    def on_host(self, rows):
        return rows is not self.device_rows


def test_rows_in_device_memory_are_gathered_there_byte_exact():
    """A load whose rows lie partly in a host buffer and partly in device memory (NVMe read into
    device staging rows), in chunks of 4 (one mixing both): the device rows are gathered on the
    device (no host copy, no ring piece for a chunk of device rows only), byte-exact, one event per
    layer."""
    kv = probes.views("LBHNC", 4, 32, 2, 16, 8, torch.bfloat16, "cpu")
    lay = KVLayout(kv)
    bb = lay.block_bytes
    g = torch.Generator().manual_seed(5)
    a = torch.randint(0, 256, (10, bb), generator=g, dtype=torch.uint8)
    d = torch.randint(0, 256, (8, bb), generator=g, dtype=torch.uint8)
    st = probes.DeferredStreams()
    dc = DeviceRows(lay.canon, lay.offsets, st, staging_bytes=4 * bb, pin=False, device_rows=d)
    trace = dc.traced()
    parts = [(a, [5, 1], [7, 2]), (d, [9, 3, 4], [0, 5, 2]), (a, [11], [3]), (d, [0, 20, 21], [6, 1, 7])]
    assert len(dc.load_parts(parts)) == 4
    st.drain()
    for host, ids, rows in parts:
        for blk, r in zip(ids, rows):
            assert torch.equal(torch.cat([probes.canonical(t, blk) for t in kv.values()]), host[r]), (blk, r)
    ring = dc.ring.buf.tensor
    pieces = [n for p, n in trace if ring.data_ptr() <= p < ring.data_ptr() + ring.numel()]
    assert len(pieces) == 4     # chunks of 4: host rows 2, 3, 7 and device row 0; device rows only (twice)
    dc.close()


def step_hooks(w: KVTierWorker, loads=(), stores=()) -> None:
    """One step's hooks, no report (the copies stay queued)."""
    w.bind(KVTierMetadata(loads=list(loads), stores=list(stores)))
    w.start_load()
    w.save()


def canon_rows(kv: dict[str, torch.Tensor], blocks) -> list[torch.Tensor]:
    return [torch.cat([probes.canonical(t, b) for t in kv.values()]) for b in blocks]


def test_scattered_store_rows_take_one_copy_and_round_trip_byte_exact(counting_kv):
    """20 blocks stored into slots two apart in random order (20 runs, more than the 6 layers):
    the kernels per layer and one device->host copy (before: one per run, 19 more); the DRAM rows
    are written by the host once the copy completed, when the store is reported (not before),
    byte-exact; loaded back (rows apart), byte-exact."""
    w, st, kv = counting_kv
    g = torch.Generator().manual_seed(11)
    for t in kv.values():
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=g, dtype=torch.uint8))
    orig = {n: t.clone() for n, t in kv.items()}
    slots = (2 * torch.randperm(20, generator=g)).tolist()
    blocks = list(range(3, 23))
    rows = w.pools[0].buffer.view(64, -1)
    st.drain()
    s0 = len(st.q["side"])
    step_hooks(w, stores=[StoreOp(1 + i, 0, slots[2 * i:2 * i + 2], blocks[2 * i:2 * i + 2]) for i in range(10)])
    s1 = len(st.q["side"])
    st.drain()
    assert sum(st.item_launches["side"][s0:s1]) == 2 * LAYERS + 2      # the kernels, the indices, one copy
    assert not rows[slots].any()                                      # in the bounce ring until the report
    assert w.take_report().stored == {1 + i: [True, True] for i in range(10)}
    assert all(torch.equal(rows[s], want) for s, want in zip(slots, canon_rows(orig, blocks)))
    for t in kv.values():
        t[40:60].zero_()
    ld, _, _ = counted_step(w, st, [LoadOp("r", 0, slots, list(range(40, 60)))], [])
    assert ld == 2 * LAYERS + 1
    for n, t in kv.items():
        assert torch.equal(t[40:60].view(torch.uint8), orig[n][3:23].view(torch.uint8)), n
    assert w.totals.get(Metric.STORE_BOUNCE_FULL.key, 0) == 0


def test_a_full_bounce_ring_copies_run_by_run_counted_byte_exact(counting_kv, caplog):
    """Chunks of 4 blocks, a store bounce ring of 8 rows: a step of 8 scattered blocks fills it; the
    next step's 4, queued while the first's copies have not run, find it in use: copied run by
    run (no host wait), counted and logged once; a third step, once the first two were reported,
    uses the ring again. Every row byte-exact."""
    w, st, kv = counting_kv
    for t in kv.values():
        t.normal_()
    dc = w.kv.device
    dc.chunk, dc.direct_runs = 4, 2
    per_chunk = 2 * LAYERS + 1
    st.drain()
    s0 = len(st.q["side"])
    step_hooks(w, stores=[StoreOp(1, 0, [0, 2, 4, 6, 8, 10, 12, 14], list(range(8)))])
    s1 = len(st.q["side"])
    step_hooks(w, stores=[StoreOp(2, 0, [20, 22, 24, 26], [10, 11, 12, 13])])
    s2 = len(st.q["side"])
    assert dc.bounce.size == 8
    st.drain()
    n = st.item_launches["side"]
    assert sum(n[s0:s1]) == 2 * per_chunk + 1 and sum(n[s1:s2]) == 2 * LAYERS + 4 + 1
    assert w.totals[Metric.STORE_BOUNCE_FULL.key] == 1
    assert "bounce ring" in caplog.text
    assert w.take_report().stored == {1: [True] * 8, 2: [True] * 4}
    s3 = len(st.q["side"])
    step_hooks(w, stores=[StoreOp(3, 0, [30, 32, 34, 36], [20, 21, 22, 23])])
    s4 = len(st.q["side"])
    st.drain()
    assert sum(st.item_launches["side"][s3:s4]) == per_chunk + 1
    assert w.take_report().stored == {3: [True] * 4}
    assert w.totals[Metric.STORE_BOUNCE_FULL.key] == 1
    rows = w.pools[0].buffer.view(64, -1)
    for sl, b in zip([0, 2, 4, 6, 8, 10, 12, 14, 20, 22, 24, 26, 30, 32, 34, 36],
                     list(range(8)) + [10, 11, 12, 13, 20, 21, 22, 23]):
        assert torch.equal(rows[sl], canon_rows(kv, [b])[0]), (sl, b)


class Failing(probes.DeferredStreams):
    """Events in `bad` report a device error when queried or waited for."""

    def __init__(self) -> None:
        super().__init__()
        self.bad: set[int] = set()

    def query(self, event):
        if event in self.bad:
            raise RuntimeError("device copy failed")
        return super().query(event)

    def sync(self, event):
        if event in self.bad:
            raise RuntimeError("device copy failed")
        super().sync(event)


def test_a_failed_scattered_store_never_reaches_its_rows():
    """A scattered store whose copy reports an error when polled is not stored and its bounce
    piece is forgotten: its rows are never written (before: the device's copy wrote them), not
    even when a later store's pieces are scattered; one whose wait fails (`handle_preemptions`
    settling its blocks) likewise, the rows keeping the bytes last stored there. Byte-exact."""
    st = Failing()
    kv = probes.views("LBNHC", LAYERS, 80, 2, 16, 8, torch.bfloat16, "cpu")
    for t in kv.values():
        t.normal_()
    w = KVTierWorker(worker_settings(64), copy_streams=st)
    w.register_kv_caches(kv)
    rows = w.pools[0].buffer.view(64, -1)
    slots, other = [1, 3, 5, 7, 9, 11, 13, 15], [41 + 2 * i for i in range(8)]

    def stored(op_id, at, blocks, fail=False, settle=False):
        step_hooks(w, stores=[StoreOp(op_id, 0, at, blocks)])
        if fail:
            st.bad.add(st.record())       # the store's event: nothing is queued after it
        if settle:
            w.handle_preemptions(KVTierMetadata(settle=[blocks[0]]))
        st.drain()
        ok = w.take_report().stored == {op_id: [not fail] * len(at)}
        st.bad.clear()
        return ok and (fail or all(torch.equal(rows[s], want) for s, want in zip(at, canon_rows(kv, blocks))))

    assert stored(1, slots, list(range(8)), fail=True)
    assert w.totals[Metric.STORE_COPY_FAILED.key] == 1
    assert stored(2, other, list(range(40, 48)))          # its pieces scattered: not the failed one's
    assert not rows[slots].any()
    assert stored(3, slots, list(range(20, 28)))
    assert stored(4, slots, list(range(30, 38)), fail=True, settle=True)
    assert w.totals[Metric.STORES_DROPPED.key] == 8
    assert stored(5, other, list(range(50, 58)))
    assert all(torch.equal(rows[s], want) for s, want in zip(slots, canon_rows(kv, range(20, 28))))
    w.close()
