"""kvtier's worker data path on a lent GPU machine (no vLLM, no network): one line per check,
figures to one JSON file. Run through `benchmarks/gpu/check.sh` (which installs the carried
wheels and makes the tree importable); `--cpu` runs the same harness without CUDA (the ordering
probes, the preemption one included, on `probes.DeferredStreams`, the GPU-only checks reported as
skipped).

Exit status: 0 when every check that ran passed; 1 when one failed; 2 without CUDA (not --cpu).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

RESULTS: dict[str, Any] = {"checks": {}}
FAILED: list[str] = []


def report(name: str, status: str, detail: str, **figures: Any) -> None:
    RESULTS["checks"][name] = {"status": status, "detail": detail, **figures}
    if status == "FAIL":
        FAILED.append(name)
    print(f"check {name}: {status}: {detail}", flush=True)


def check(name: str, needs_gpu: bool = False):
    def wrap(fn: Callable[[], None]) -> Callable[[bool], None]:
        def run(gpu: bool) -> None:
            if needs_gpu and not gpu:
                report(name, "SKIP", "needs CUDA (skipped: --cpu)")
                return
            t0 = time.perf_counter()
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - one line per check, the traceback in the file
                report(name, "FAIL", f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
            RESULTS["checks"].setdefault(name, {})["seconds"] = round(time.perf_counter() - t0, 2)
        run.__name__ = name
        return run
    return wrap


def _median_s(fn: Callable[[], Any], repeat: int, sync: Callable[[], None]) -> float:
    times = []
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---- checks that run everywhere -------------------------------------------------------------
BLOCK_VLLM = ("import sys, importlib.abc\n"
              "class B(importlib.abc.MetaPathFinder):\n"
              "    def find_spec(self, n, p, t=None):\n"
              "        if n == 'vllm' or n.startswith('vllm.'): raise ImportError('no vLLM here')\n"
              "sys.meta_path.insert(0, B())\n"
              "import kvtier.connector.worker, kvtier.connector.kv_layout, kvtier.connector.device_copy\n"
              "print(sorted(m for m in sys.modules if m.startswith('vllm')))\n")


@check("imports_without_vllm")
def imports_without_vllm() -> None:
    r = subprocess.run([sys.executable, "-c", BLOCK_VLLM], capture_output=True, text=True, timeout=120, cwd=HERE)
    if r.returncode != 0 or r.stdout.strip() != "[]":
        report("imports_without_vllm", "FAIL", (r.stderr.strip().splitlines() or ["?"])[-1])
    else:
        report("imports_without_vllm", "PASS", "worker, kv_layout, device_copy import with vLLM blocked")


def _streams_fn(gpu: bool, prefer: str = "side"):
    import probes
    if gpu:
        import torch

        from kvtier.connector.device_copy import CudaStreams
        return lambda: CudaStreams(torch.device("cuda"))
    return lambda: probes.DeferredStreams(prefer)


def layouts(gpu: bool) -> None:
    import probes
    bad = probes.layouts_roundtrip("cuda" if gpu else "cpu", _streams_fn(gpu))
    n = (len(probes.ORDERS) + 2) ** 2
    report("layouts", "FAIL" if bad else "PASS",
           f"{n - len(bad)}/{n} layout pairs byte-exact (NHD, HND, BL*, LHBNC, 2-way kernel splits)"
           + (f"; failed {bad[:4]}" if bad else ""), pairs=n, failed=bad)


def _probe(gpu: bool, which: str) -> None:
    import torch

    import probes
    fn = probes.store_probe if which == "store" else probes.load_probe
    prefer = "side" if which == "store" else "compute"
    name = f"{which}_probe"
    device = "cuda" if gpu else "cpu"
    compute = torch.cuda.Stream() if gpu else None
    ctx = torch.cuda.stream(compute) if gpu else _null()
    with ctx:   # the forward's stream: not the legacy default stream (it would order everything)
        rig = probes.Rig(device, _streams_fn(gpu, prefer)())
        try:
            ok = [fn(rig) for _ in range(3)]
            unordered = [fn(rig, ordered=False) for _ in range(3)]
        finally:
            rig.close()
    what = "stored bytes are the pattern" if which == "store" else "compute-stream reads equal the source"
    what += "" if gpu else " (CPU: probes.DeferredStreams)"
    off = "fence" if which == "store" else "compute_wait"
    if not all(ok):
        report(name, "FAIL", f"{what}: {ok.count(True)}/3", ordered=ok, unordered=unordered)
    elif all(unordered):
        report(name, "FAIL", f"{what} 3/3, but also with {off} off: the probe cannot see a missing wait",
               ordered=ok, unordered=unordered)
    else:
        report(name, "PASS", f"{what} 3/3; with {off} off {unordered.count(False)}/3 stale (the probe sees it)",
               ordered=ok, unordered=unordered)


def preempt(gpu: bool) -> None:
    """`probes.preempt_probe` 3 times settled, 3 times not (where it must see the rewrite); on
    CPU through `DeferredStreams`."""
    import torch

    import probes
    device = "cuda" if gpu else "cpu"
    compute = torch.cuda.Stream() if gpu else None
    with torch.cuda.stream(compute) if gpu else _null():
        rig = probes.Rig(device, _streams_fn(gpu)())
        try:
            ok = [probes.preempt_probe(rig) for _ in range(3)]
            unsettled = [probes.preempt_probe(rig, settled=False) for _ in range(3)]
            waits = rig.w.totals.get("store_settle_waits", 0)
        finally:
            rig.close()
    what = "a preempted request's block rewritten on another stream is stored with the forward's bytes"
    what += "" if gpu else " (CPU: probes.DeferredStreams)"
    if not all(ok) or waits != 3:
        report("preempt_probe", "FAIL", f"{what}: {ok.count(True)}/3, {waits} settle waits",
               settled=ok, unsettled=unsettled, settle_waits=waits)
    elif all(unsettled):
        report("preempt_probe", "FAIL", f"{what} 3/3, but also without handle_preemptions: the probe cannot "
               "see a missing settle", settled=ok, unsettled=unsettled, settle_waits=waits)
    else:
        report("preempt_probe", "PASS", f"{what} 3/3; without handle_preemptions {unsettled.count(False)}/3 "
               "stored the rewrite (the probe sees it)", settled=ok, unsettled=unsettled, settle_waits=waits)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def tp_reports(gpu: bool) -> None:
    """Tensor parallel stores reported in different steps: two ranks (two workers in one process,
    each its own copy stream and pool) store the same op; rank 1's forward runs late (0.1 s of sleep
    on its compute stream; on CPU its deferred copies run two steps after rank 0's), so the ranks
    report the store in different steps. The controller (ranks=2) commits it only in the step the
    second report arrives, byte-exact in both pools."""
    import copy

    import torch

    import probes
    from kvtier.connector.config import load_settings
    from kvtier.connector.metadata import KVTierMetadata
    from kvtier.connector.worker import KVTierWorker
    from kvtier.core.controller import TierController
    from kvtier.policies import EVICTION
    from kvtier.tiers.base import SlotTier
    device = "cuda" if gpu else "cpu"
    streams = [_streams_fn(gpu)() for _ in range(2)]
    ranks = []
    for r in range(2):
        kv = probes.views("LBNHC", 4, 64, 8, 16, 128, torch.bfloat16, device)
        for t in kv.values():
            t.normal_()
        w = KVTierWorker(load_settings({"cpu_capacity_blocks": 16, "pin": gpu}), rank=r, ranks=2,
                         copy_streams=streams[r])
        w.register_kv_caches(kv)
        ranks.append((w, kv))
    try:
        tier = SlotTier("cpu", 16, ranks[0][0].layout.block_bytes, EVICTION.get("lru")(16))
        ctrl = TierController([tier], ranks=2)
        ids = [5, 6, 7]
        ctrl.store([bytes([b]) * 16 for b in ids], ids)
        (op,) = ctrl.take_plan().stores
        if gpu:
            torch.cuda.synchronize()
        for w, _ in ranks:
            ctx = torch.cuda.stream(torch.cuda.Stream()) if gpu else _null()   # each rank's forward stream
            with ctx:
                if gpu and w.rank == 1:
                    torch.cuda._sleep(probes.SLEEP_CYCLES)   # rank 1's forward runs late: its copy waits
                w.bind(KVTierMetadata(stores=copy.deepcopy([op])))
                w.save()
        steps: list[tuple[list[int], int]] = []   # per step: the ranks reporting the store, blocks resident
        done: dict = {}
        for i in range(10_000):
            if not gpu and i in (1, 3):
                streams[0 if i == 1 else 1].drain()
            agg = None
            who = []
            for w, _ in ranks:
                w.bind(KVTierMetadata())
                rep = w.take_report()
                if rep is not None and op.op_id in rep.stored:
                    who.append(w.rank)
                if rep is not None:
                    agg = rep if agg is None else agg.aggregate(rep)
            done = (ctrl.complete(agg) if agg is not None else None) or {}
            if who:
                steps.append((who, tier.num_resident))
            if done:
                break
            if gpu:
                time.sleep(0.001)
        if gpu:
            torch.cuda.synchronize()
        exact = all(torch.equal(w.pools[0].buffer.view(16, -1)[s].cpu(),
                                torch.cat([probes.canonical(t, b) for t in kv.values()]))
                    for w, kv in ranks for b, s in zip(ids, op.slots))
    finally:
        for w, _ in ranks:
            w.close()
    split = len(steps) == 2 and steps[0][1] == 0 and len(steps[0][0]) == 1
    ok = split and done == {op.op_id: [True] * 3} and tier.num_resident == 3 and exact
    report("tp_reports", "PASS" if ok else "FAIL",
           f"the ranks reported the store in steps {[w for w, _ in steps]}; resident after each "
           f"{[n for _, n in steps]} (committed only with the second); byte-exact on both ranks {exact}",
           steps=[w for w, _ in steps], resident=[n for _, n in steps], exact=exact)


# ---- GPU-only checks --------------------------------------------------------------------------
@check("two_registrations", needs_gpu=True)
def two_registrations() -> None:
    """The device copier's store and load of a row run across the end of one cudaHostRegister
    chunk: cut there (every host range copied, indices included, inside one registration),
    byte-exact; GB/s of the cut run vs a run inside one chunk."""
    import torch

    import probes
    from kvtier.connector.device_copy import CudaStreams, DeviceCopier
    from kvtier.connector.kv_layout import KVLayout
    from kvtier.tiers import cpu_pool
    kv = probes.views("LBNHC", 8, 64, 8, 16, 256, torch.bfloat16, "cuda")    # 512 KiB blocks
    for t in kv.values():
        t.normal_()
    lay = KVLayout(kv)
    bb = lay.block_bytes
    old = cpu_pool.REGISTER_CHUNK_BYTES
    cpu_pool.REGISTER_CHUNK_BYTES = 32 * bb          # two registrations of 32 rows
    try:
        buf = cpu_pool.host_buffer(64 * bb, pin=True, row_bytes=bb, what="check buffer")
    finally:
        cpu_pool.REGISTER_CHUNK_BYTES = old
    try:
        rows = buf.tensor.view(64, bb)
        dc = DeviceCopier(lay.canon, lay.offsets, CudaStreams(lay.device), pin=True)
        trace = dc.traced()
        ids, slots, back = list(range(16)), list(range(24, 40)), list(range(32, 48))   # rows 24..39
        dc.sync(dc.store(rows, ids, slots))
        store_ok = all(torch.equal(rows[s], torch.cat([probes.canonical(t, b) for t in kv.values()]))
                       for b, s in zip(ids, slots))
        dc.sync(dc.load(rows, back, slots)[-1])
        load_ok = all(torch.equal(t[b], t[a]) for t in kv.values() for a, b in zip(ids, back))
        chunks = buf.chunks + dc.index.buf.chunks + dc.ring.buf.chunks   # the load's layer-major host staging
        inside = all(any(p <= a and a + n <= p + sz for p, sz in chunks) for a, n in trace)
        runs = sum(1 for a, _ in trace if buf.chunks[0][0] <= a < buf.chunks[0][0] + 64 * bb)
        dc.trace = dc.index.trace = None
        sync = torch.cuda.synchronize
        across = _median_s(lambda: dc.store(rows, ids, slots), 9, sync)
        within = _median_s(lambda: dc.store(rows, ids, list(range(16))), 9, sync)
        regs = len(buf.chunks)
        ok = store_ok and load_ok and inside and regs == 2 and runs == 4
        report("two_registrations", "PASS" if ok else "FAIL",
               f"{regs} registrations; store/load across the boundary byte-exact {store_ok}/{load_ok}, "
               f"cut into {runs // 2} copies each way, every host range in one registration {inside}; "
               f"{16 * bb / across / 1e9:.1f} GB/s across vs {16 * bb / within / 1e9:.1f} inside one",
               registrations=regs, copies=runs, inside=inside, across_gbps=16 * bb / across / 1e9,
               inside_gbps=16 * bb / within / 1e9)
        dc.close()
    finally:
        buf.close()


@check("hook_wait", needs_gpu=True)
def hook_wait() -> None:
    """`wait_for_save` returns while the forward (0.1 s of sleep on the compute stream) still runs
    and its store's copy waits behind it; a later poll reports the store, byte-exact."""
    import torch

    import probes
    from kvtier.connector.device_copy import CudaStreams
    from kvtier.connector.metadata import KVTierMetadata, StoreOp
    compute = torch.cuda.Stream()
    with torch.cuda.stream(compute):
        rig = probes.Rig("cuda", CudaStreams(torch.device("cuda")), layers=32)
        try:
            for t in rig.kv.values():
                t.normal_()
            torch.cuda.synchronize()
            want = torch.cat([probes.canonical(t, 5) for t in rig.kv.values()])
            torch.cuda._sleep(probes.SLEEP_CYCLES)
            t0 = time.perf_counter()
            rig.w.bind(KVTierMetadata(stores=[StoreOp(1, 0, [3], [5])]))
            rig.w.save()
            r = rig.w.take_report()
            host_ms = (time.perf_counter() - t0) * 1e3
            early = r is not None and 1 in r.stored
            polls = 0
            while not early and polls < 10_000:
                polls += 1
                r = rig.w.take_report()
                if r is not None and 1 in r.stored:
                    break
                time.sleep(0.001)
            exact = r is not None and r.stored.get(1) == [True] and torch.equal(rig.rows[3], want)
        finally:
            rig.close()
    ok = not early and exact and polls > 0
    report("hook_wait", "PASS" if ok else "FAIL",
           f"wait_for_save + report {host_ms:.2f} ms with 0.1 s of compute queued; reported stored "
           f"{'in the same step' if early else f'after {polls} polls'}; byte-exact {exact}",
           host_ms=host_ms, polls=polls, same_step=early, exact=exact)


@check("scattered_copies", needs_gpu=True)
def scattered_copies() -> None:
    """Scattered stores / loads of N blocks (NHD bf16, canonical order) vs one pinned memcpy, as one
    request and, at 80 layers, as N one-block requests (one step's batch); byte-exact both ways."""
    import torch

    import probes
    from kvtier.connector.device_copy import CudaStreams, DeviceCopier
    from kvtier.connector.kv_layout import KVLayout
    from kvtier.tiers.cpu_pool import host_buffer
    out = []
    for layers, heads, content, bt, n, reqs, nblocks in ((32, 8, 256, 16, 256, 1, 2048),   # GQA
                                                         (64, 1, 576, 64, 128, 1, 2048),   # MLA-like
                                                         (80, 8, 256, 16, 128, 128, 1024)):   # 80 layers, many requests
        kv = probes.views("LBNHC", layers, nblocks, heads, bt, content, torch.bfloat16, "cuda")
        for t in kv.values():
            t.normal_()
        lay = KVLayout(kv)
        bb = lay.block_bytes
        buf = host_buffer(2 * n * bb, pin=True, row_bytes=bb, what="check pool")
        rows = buf.tensor.view(-1, bb)
        dc = DeviceCopier(lay.canon, lay.offsets, CudaStreams(lay.device))
        g = torch.Generator().manual_seed(0)
        ids = torch.randperm(nblocks, generator=g)[:n].tolist()
        slots = torch.randperm(2 * n, generator=g)[:n].tolist()
        parts = [(rows, ids[i::reqs], slots[i::reqs]) for i in range(reqs)]
        dc.sync(dc.store_parts(parts))
        want = {b: torch.cat([probes.canonical(t, b) for t in kv.values()]) for b in ids[:16]}
        exact = all(torch.equal(rows[s], want[b]) for b, s in zip(ids[:16], slots[:16]))   # before any load
        dev = torch.empty(n * bb, dtype=torch.uint8, device="cuda")
        host = rows[:n].reshape(-1)
        sync = torch.cuda.synchronize
        d2h = _median_s(lambda: host.copy_(dev, non_blocking=True), 7, sync)
        h2d = _median_s(lambda: dev.copy_(host, non_blocking=True), 7, sync)
        st = _median_s(lambda: dc.sync(dc.store_parts(parts)), 7, sync)
        ld = _median_s(lambda: dc.sync(dc.load_parts(parts)[-1]), 7, sync)
        for t in kv.values():
            t[ids[:16]] = 0
        dc.sync(dc.load_parts(parts)[-1])
        load_exact = all(torch.equal(torch.cat([probes.canonical(t, b) for t in kv.values()]), want[b]) for b in ids[:16])
        nb = n * bb
        out.append({"layers": layers, "requests": reqs, "block_bytes": bb, "blocks": n, "store_exact": exact,
                    "load_exact": load_exact, "d2h_gbps": nb / d2h / 1e9, "h2d_gbps": nb / h2d / 1e9,
                    "store_gbps": nb / st / 1e9, "load_gbps": nb / ld / 1e9, "store_ratio": d2h / st,
                    "load_ratio": h2d / ld})
        dc.close()
        buf.close()
        del kv, lay, dc, dev
        torch.cuda.empty_cache()
    ok = all(o["store_exact"] and o["load_exact"] for o in out)
    report("scattered_copies", "PASS" if ok else "FAIL", "; ".join(
        f"{o['layers']} layers, {o['blocks']} x {o['block_bytes'] >> 10} KiB in {o['requests']} request(s): "
        f"store {o['store_gbps']:.1f} GB/s ({o['store_ratio']:.2f}x one memcpy), load {o['load_gbps']:.1f} GB/s "
        f"({o['load_ratio']:.2f}x), byte-exact {o['store_exact']}/{o['load_exact']}" for o in out), runs=out)


LAYER0_SLACK = 0.05   # layer 0 may wait for its own share of a load's bytes (1/layers) and this much more


def layer0_wait(copier: Any = None, layers: int = 80, requests: int = 16, chunks: int = 4) -> dict:
    """What the forward's first layer waits for, counted on CPU (`probes.DeferredStreams(count=True)`):
    the share of a load's bytes (host->device copies, scatters, indices) queued before layer 0's
    event, for `requests` one-block loads with rows apart in one staging chunk, and in `chunks`
    chunks. `copier`: the device copier class (default `DeviceCopier`)."""
    import torch

    import probes
    from kvtier.connector.device_copy import DeviceCopier
    from kvtier.connector.kv_layout import KVLayout
    kv = probes.views("LBNHC", layers, 4 * requests, 1, 16, 16, torch.bfloat16, "cpu")
    lay = KVLayout(kv)
    out = {}
    for name, n_chunks in (("one_chunk", 1), ("chunks", chunks)):
        st = probes.DeferredStreams(count=True)
        per = -(-requests // n_chunks)
        dc = (copier or DeviceCopier)(lay.canon, lay.offsets, st, staging_bytes=per * lay.block_bytes, pin=False)
        rows = torch.zeros(3 * requests, lay.block_bytes, dtype=torch.uint8)
        events = dc.load_parts([(rows, [2 * requests + i], [3 * i]) for i in range(requests)])
        st.drain()
        b = st.item_bytes["side"]
        out[name] = sum(b[:events[0]]) / sum(b)
        dc.close()
    return out


def layer_overlap(gpu: bool, copier: Any = None) -> None:
    """Layer 0's wait: at most 1/layers + 5% of a load's bytes come before its event (counted on
    CPU, one chunk and four); on a GPU also per-layer loads against per-layer compute (both with
    `wait_layer` vs each alone) and the device time to layer 0's event over the whole load's."""
    layers = 80
    frac = layer0_wait(copier, layers)
    bound = 1 / layers + LAYER0_SLACK
    ok = all(f <= bound for f in frac.values())
    detail = (f"layer 0 waits for {frac['one_chunk']:.1%} of a 16-request load's bytes ({frac['chunks']:.1%} "
              f"in 4 chunks), bound 1/{layers} + {LAYER0_SLACK:.0%} = {bound:.1%}")
    figures: dict = {"layer0_wait_fraction": frac, "bound": bound}
    if gpu:
        figures.update(_overlap_gpu())
        detail += (f"; GPU, {figures['gpu_layers']} layers: layer 0 done at {figures['gpu_layer0_time_fraction']:.1%} "
                   f"of the load's device time; load {figures['load_ms']:.1f} ms, compute {figures['compute_ms']:.1f} ms, "
                   f"both with per-layer waits {figures['both_ms']:.1f} ms ({figures['hidden']:.0%} of the shorter hidden)")
    report("layer_overlap", "PASS" if ok else "FAIL", detail, **figures)


def _overlap_gpu() -> dict:
    import torch

    import probes
    from kvtier.connector.config import load_settings
    from kvtier.connector.device_copy import CudaStreams
    from kvtier.connector.metadata import KVTierMetadata, LoadOp
    from kvtier.connector.worker import KVTierWorker

    class Timed(CudaStreams):
        def record(self):
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(self.stream)
            return ev

    layers, n = 16, 256
    compute = torch.cuda.Stream()
    with torch.cuda.stream(compute):
        kv = probes.views("LBNHC", layers, 2048, 8, 16, 256, torch.bfloat16, "cuda")
        st = Timed(torch.device("cuda"))
        w = KVTierWorker(load_settings({"cpu_capacity_blocks": n, "pin": True}), copy_streams=st)
        w.register_kv_caches(kv)
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        names = list(kv)
        sync = torch.cuda.synchronize
        seq = iter(range(1 << 30))

        def work():
            a @ a

        def bind():
            w.bind(KVTierMetadata(loads=[LoadOp(f"o{next(seq)}", 0, list(range(n)), list(range(n)))]))

        def load():
            bind()
            w.start_load()
            for name in names:
                w.wait_layer(name)
                work()
            w.take_report()

        def load_only():
            bind()
            w.start_load()
            w.take_report()

        load()
        t_c = _median_s(lambda: [work() for _ in names], 5, sync)
        t_l = _median_s(load_only, 5, sync)
        t_both = _median_s(load, 5, sync)
        sync()
        start = st.record()          # the side stream is idle: the load's copies start after this
        events = w.kv.device.load(w.pools[0].buffer.view(n, -1), list(range(n)), list(range(n)))
        sync()
        first, whole = start.elapsed_time(events[0]), start.elapsed_time(events[-1])
        w.close()
    return {"gpu_layers": layers, "gpu_layer0_time_fraction": first / whole if whole > 0 else 0.0,
            "load_ms": t_l * 1e3, "compute_ms": t_c * 1e3, "both_ms": t_both * 1e3,
            "hidden": (t_c + t_l - t_both) / min(t_c, t_l)}


@check("kvikio", needs_gpu=True)
def kvikio_check() -> None:
    """kvikio's mode, and its device- and host-buffer reads vs POSIX O_DIRECT, same file."""
    import mmap

    import torch
    try:
        import kvikio
        import kvikio.defaults
    except Exception as e:  # noqa: BLE001
        report("kvikio", "FAIL", f"kvikio does not import: {e}")
        return
    compat = bool(kvikio.defaults.is_compat_mode_preferred())
    setting = kvikio.defaults.get("compat_mode")
    try:
        import kvikio.cufile_driver
        gds = kvikio.cufile_driver.get("is_gds_available")
    except Exception as e:  # noqa: BLE001 - no cuFile driver: say so
        gds = f"unknown ({e})"
    mode = (f"compatibility (POSIX in kvikio's threads; compat_mode={setting}, GDS available: {gds})" if compat
            else f"GDS (cuFile; compat_mode={setting}, GDS available: {gds})")
    size = 256 << 20
    d = tempfile.mkdtemp(dir=os.environ.get("KVTIER_CHECK_DIR") or os.getcwd())   # a disk, not a tmpfs
    path = os.path.join(d, "kvikio.bin")
    with open(path, "wb") as f:
        f.write(os.urandom(size))
        f.flush()
        os.fsync(f.fileno())

    def drop():
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)

    def timed(fn) -> float:
        times = []
        for _ in range(3):
            drop()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return size / statistics.median(times) / 1e9

    dev = torch.empty(size, dtype=torch.uint8, device="cuda")
    host = torch.empty(size, dtype=torch.uint8).pin_memory()
    mm = mmap.mmap(-1, size)

    def kv_read(buf):
        with kvikio.CuFile(path, "r") as f:
            f.read(buf)

    def posix():
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            os.preadv(fd, [mm], 0)
        finally:
            os.close(fd)

    out = {"mode": mode}
    out["device_gbps"] = timed(lambda: kv_read(dev))
    out["host_gbps"] = timed(lambda: kv_read(host.numpy()))
    try:
        out["posix_odirect_gbps"] = timed(posix)
        same_posix = bytes(mm[:4096]) == host[:4096].numpy().tobytes()
    except OSError as e:   # O_DIRECT refused by this file system
        out["posix_odirect_gbps"], out["posix_error"], same_posix = float("nan"), str(e), True
    same = torch.equal(dev.cpu(), host) and same_posix
    os.unlink(path)
    os.rmdir(d)
    report("kvikio", "PASS" if same else "FAIL",
           f"{mode}; 256 MiB cold: device buffer {out['device_gbps']:.2f} GB/s, host buffer "
           f"{out['host_gbps']:.2f}, POSIX O_DIRECT {out['posix_odirect_gbps']:.2f}; same bytes {same}", **out)


@check("gds_load", needs_gpu=True)
def gds_load() -> None:
    """NVMe -> GPU loads of kvtier's data plane, verified: with GDS (io: kvikio, format 4: file ->
    device rows, the keyed sum checked on the GPU) and without (io: posix, format 2: file -> pinned
    host rows, xxh3 on the host, then one H2D copy), against a pinned H2D memcpy of the same bytes
    and the raw kvikio read of the same file range (no verification). Also: the keyed sum on the
    GPU equals the host's, a flipped byte fails on the GPU, no payload byte bounced via the host."""
    import torch

    from kvtier.policies import EVICTION
    from kvtier.tiers.nvme_control import NvmeControl
    from kvtier.tiers.nvme_data import NvmeData
    try:
        import kvikio
    except Exception as e:  # noqa: BLE001
        report("gds_load", "FAIL", f"kvikio does not import: {e}")
        return
    bb, n = 2 << 20, 64                                  # 128 MiB of 2 MiB blocks
    root = tempfile.mkdtemp(dir=os.environ.get("KVTIER_CHECK_DIR") or os.getcwd())   # a disk, not a tmpfs
    g = torch.Generator(device="cuda").manual_seed(0)
    src = torch.randint(0, 256, (n, bb), dtype=torch.uint8, device="cuda", generator=g)
    keys = [b"gds%04d" % i for i in range(n)]
    slots = list(range(n))
    planes, ctls = {}, []
    try:
        for io in ("kvikio", "posix"):
            ctl = NvmeControl(io, os.path.join(root, io), n, bb, EVICTION.get("lru")(n), {"model": "check"})
            ctls.append(ctl)
            planes[io] = NvmeData(ctl.dir, n, bb, io, 4, name=io)
        gd, px = planes["kvikio"], planes["posix"]
        host_src = src.cpu().pin_memory()
        w = gd.write(slots, list(src.unbind(0)), keys).wait()        # device -> file, hashed on the GPU
        wp = px.write(slots, list(host_src.unbind(0)), keys).wait()  # host -> file (O_DIRECT), xxh3
        gd.sync()
        px.sync()
        assert w.all_ok and wp.all_ok, (w.errors[:1], wp.errors[:1])
        codec = gd.codec
        sums_ok = all(codec.payload_sum(src[i, :k]) == codec.payload_sum(host_src[i, :k])
                      for i, k in ((0, bb), (1, 4097), (2, 1), (3, 12289)))

        def drop(p: NvmeData) -> None:
            os.posix_fadvise(p.file.fd, 0, 0, os.POSIX_FADV_DONTNEED)

        def timed(fn, cold: NvmeData | None) -> float:
            times = []
            for _ in range(3):
                if cold is not None:
                    drop(cold)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            return n * bb / statistics.median(times) / 1e9

        dev_rows = torch.empty((n, bb), dtype=torch.uint8, device="cuda")
        host_rows = torch.empty((n, bb), dtype=torch.uint8).pin_memory()
        dev2 = torch.empty_like(dev_rows)
        oks: dict[str, bool] = {}

        def gds_read() -> None:
            r = gd.read(slots, list(dev_rows.unbind(0)), keys, w.tags).wait()
            oks["gds"] = r.all_ok

        def host_read() -> None:
            r = px.read(slots, list(host_rows.unbind(0)), keys, wp.tags).wait()
            dev2.copy_(host_rows, non_blocking=True)
            oks["posix"] = r.all_ok

        stride = gd.stride
        raw = torch.empty(n * stride, dtype=torch.uint8, device="cuda")

        def raw_read() -> None:
            with kvikio.CuFile(gd.path, "r") as f:
                f.read(raw)

        out: dict[str, Any] = {"mode": gd.engine.mode, "engine": gd.description, "block_bytes": bb, "blocks": n}
        before = gd.engine.stats()["host_payload_bytes"]
        out["gds_load_gbps"] = timed(gds_read, gd)
        out["posix_load_gbps"] = timed(host_read, px)
        out["raw_kvikio_gbps"] = timed(raw_read, gd)
        out["pinned_h2d_gbps"] = timed(lambda: dev2.copy_(host_rows, non_blocking=True), None)
        out["host_payload_bytes"] = gd.engine.stats()["host_payload_bytes"] - before
        same = bool(torch.equal(dev_rows, src) and torch.equal(dev2, src))
        # one flipped payload byte: the GPU's check fails that block only
        fd = os.open(gd.path, os.O_RDWR)
        try:
            b = os.pread(fd, 1, 5 * stride + 4096 + 99)
            os.pwrite(fd, bytes([b[0] ^ 0xFF]), 5 * stride + 4096 + 99)
            os.fsync(fd)
        finally:
            os.close(fd)
        drop(gd)
        r = gd.read(slots, list(dev_rows.unbind(0)), keys, w.tags).wait()
        flip_caught = r.ok == [i != 5 for i in range(n)] and bool(r.bad) and r.bad[5]
        good = all(oks.values()) and same and sums_ok and flip_caught and out["host_payload_bytes"] == 0
        report("gds_load", "PASS" if good else "FAIL",
               f"kvikio {out['mode']}; {n} x {bb >> 20} MiB cold, verified: GDS {out['gds_load_gbps']:.2f} GB/s, "
               f"without GDS (posix + pinned H2D) {out['posix_load_gbps']:.2f}; raw kvikio read "
               f"{out['raw_kvikio_gbps']:.2f}, pinned memcpy {out['pinned_h2d_gbps']:.2f}; same bytes {same}, "
               f"GPU sum = host sum {sums_ok}, flipped byte caught {flip_caught}, host bounce bytes "
               f"{out['host_payload_bytes']}", **out)
    finally:
        for p in planes.values():
            p.close()
        for c in ctls:
            c.close()
        import shutil
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="no CUDA: the harness, GPU-only checks skipped")
    ap.add_argument("--out", default=None, help="the JSON file of figures (default $OUT/gpu_check.json)")
    a = ap.parse_args()
    import torch
    gpu = torch.cuda.is_available()
    out = a.out or os.path.join(os.environ.get("OUT") or ".", "gpu_check.json")
    RESULTS.update({"mode": "cpu" if a.cpu else "gpu", "python": platform.python_version(),
                    "torch": torch.__version__, "cuda": torch.version.cuda,
                    "device": torch.cuda.get_device_name() if gpu else None,
                    "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())})
    if not a.cpu and not gpu:
        print("check.py: no CUDA device (torch.cuda.is_available() is False): nothing checked; "
              "`check.sh --cpu` runs the harness without one", flush=True)
        return 2
    use_gpu = gpu and not a.cpu
    print(f"check.py: {RESULTS['mode']} mode, torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"{RESULTS['device'] or 'no GPU'}", flush=True)
    t0 = time.perf_counter()
    imports_without_vllm(use_gpu)
    check("layouts")(lambda: layouts(use_gpu))(use_gpu)
    for which in ("store", "load"):
        check(f"{which}_probe")(lambda w=which: _probe(use_gpu, w))(use_gpu)
    check("tp_reports")(lambda: tp_reports(use_gpu))(use_gpu)
    check("preempt_probe")(lambda: preempt(use_gpu))(use_gpu)
    check("layer_overlap")(lambda: layer_overlap(use_gpu))(use_gpu)
    for c in (two_registrations, hook_wait, scattered_copies, kvikio_check, gds_load):
        c(use_gpu)
    RESULTS["seconds"] = round(time.perf_counter() - t0, 1)
    RESULTS["failed"] = FAILED
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)
    print(f"check.py: {len(RESULTS['checks']) - len(FAILED)}/{len(RESULTS['checks'])} checks passed or skipped "
          f"in {RESULTS['seconds']} s; figures in {out}", flush=True)
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
