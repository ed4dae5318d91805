"""GPUDirect Storage with `io: kvikio`, its logic on CPU: block format 4 (the keyed payload sum torch
computes on any device), header pages on the host, payloads read into device staging rows and
verified there before any scatter into the KV, format-2 (xxh3) blocks read through the host.

A fake kvikio (`gds_kvikio`) moves a "device" tensor's own memory (CPU tensors stand for device
memory: `KvikioEngine.device_type` is set to "cpu") and records every payload transfer, so a test
sees exactly which memory each payload touched. The GPU side runs in benchmarks/gpu/check.py.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import sys
import types
from pathlib import Path

import pytest
import torch

from kvtier.common.counters import Metric
from kvtier.core.config import ConfigError, parse_config
from kvtier.core.executor import Executor
from kvtier.core.plan import LoadOp, Plan
from kvtier.core.staging import Staging
from kvtier.connector.kv_layout import KVCopier, KVLayout
from kvtier.policies import EVICTION
from kvtier.tiers import io_kvikio
from kvtier.tiers.block_sum import KeyedSum
from kvtier.tiers.cpu_pool import CpuPool
from kvtier.tiers.io_engines import ALIGN, KvikioEngine, PosixEngine
from kvtier.tiers.nvme_block import BLOCK_VERSION, DEVICE_VERSION, BlockCodec, slot_stride
from kvtier.tiers.nvme_control import NvmeControl
from kvtier.tiers.nvme_data import NvmeData
from kvtier.tiers.sealing import Sealer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"))
import probes  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from test_io_engines import _make_fake_kvikio  # noqa: E402


def _make_gds_kvikio():
    """A stand-in for `kvikio` in GDS mode: test_io_engines' fake CuFile, moving a torch tensor's
    own memory too (as cuFile DMA moves device memory); `moved` records (op, 'device' | 'host',
    address, bytes) per payload transfer."""
    mod = _make_fake_kvikio()

    class CuFile(mod.CuFile):
        moved: list[tuple[str, str, int, int]] = []

        def is_compat_mode_preferred(self):
            return False

        def _mv(self, op, buf, size):
            if isinstance(buf, torch.Tensor):
                CuFile.moved.append((op, "device", buf.data_ptr(), size))
                return memoryview(buf.numpy()).cast("B")[:size]
            CuFile.moved.append((op, "host", 0, size))
            return memoryview(buf).cast("B")[:size]

    mod.__version__ = "0.0-gds-fake"
    mod.CuFile = CuFile
    mod.defaults = types.SimpleNamespace(get=lambda name: {"compat_mode": "OFF"}[name])
    return mod


@pytest.fixture
def gds_kvikio(monkeypatch):
    mod = _make_gds_kvikio()
    monkeypatch.setitem(sys.modules, "kvikio", mod)
    monkeypatch.setattr(io_kvikio, "cuda_driver_reason", lambda: None)   # as on a machine with a driver
    monkeypatch.setattr(KvikioEngine, "device_type", "cpu")              # CPU tensors stand for device memory
    return mod


@pytest.fixture
def data_dir(tmp_path):
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    yield str(tmp_path), fd
    os.close(fd)


def _rand(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_gds_checksum_is_the_same_on_host_bytes_and_device_tensors():
    """One function on any device: host bytes, a tensor, an unaligned slice, odd sizes agree; the
    key, one flipped bit, two top bits, two swapped words all change it."""
    codec = BlockCodec(b"s" * 32, 7, device_sum=True)
    other = BlockCodec(b"t" * 32, 7, device_sum=True)
    base = _rand(70001, 1)
    devs = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for n in (1, 7, 8, 9, 4095, 4097, 12289, 65536):
        for off in (0, 3):
            t = base[off:off + n]
            want = codec.payload_sum(bytes(t.numpy()))
            for d in devs:
                assert codec.payload_sum(t.to(d)) == want, (n, off, d)
                assert codec.payload_sum(t.clone().to(d)) == want, (n, off, d)
            assert other.payload_sum(t) != want
    t = base[:4096].clone()
    s0 = codec.payload_sum(t)
    for mutate in (lambda u: u.__setitem__(100, u[100] ^ 1),
                   lambda u: (u.__setitem__(7, u[7] ^ 0x80), u.__setitem__(15, u[15] ^ 0x80)),
                   lambda u: u[0:16].copy_(torch.cat([t[8:16], t[0:8]]))):
        u = t.clone()
        mutate(u)
        assert not torch.equal(u, t) and codec.payload_sum(u) != s0
    assert KeyedSum(5)(torch.zeros(0, dtype=torch.uint8)) == KeyedSum(5)(torch.zeros(0, dtype=torch.uint8))


def _engine_file(eng, data_dir, n, stride):
    path, dfd = data_dir
    f = eng.open(os.path.join(path, "data.0"), dir_fd=dfd)
    os.posix_fallocate(f.fd, 0, n * stride)
    return f


def test_gds_engine_keeps_payloads_off_the_host(gds_kvikio, data_dir):
    """Format 4 from and into device tensors: every payload moves between the file and the tensor
    itself, the header page alone on the host; no payload byte goes through host memory. A POSIX
    engine (host buffers) reads the same blocks."""
    bb, n = 12289, 4
    stride = slot_stride(bb)
    codec = BlockCodec(b"s" * 32, 7, device_sum=True)
    keys = [b"key%d" % i for i in range(n)]
    offs = [i * stride for i in range(n)]
    src = [_rand(bb, 10 + i) for i in range(n)]
    dst = [torch.zeros(bb, dtype=torch.uint8) for _ in range(n)]
    eng = KvikioEngine(2)
    assert eng.mode == "GDS" and "GDS" in eng.description
    try:
        f = _engine_file(eng, data_dir, n, stride)
        tags = [0] * n
        assert eng.write(f, offs, src, bb, checksums=tags, codec=codec, keys=keys).wait().all_ok
        hdr = os.pread(f.fd, 16, offs[0])
        assert struct.unpack_from("<H", hdr, 8)[0] == DEVICE_VERSION
        bad = [False] * n
        assert eng.read(f, offs, dst, bb, expect=tags, mismatched=bad, codec=codec, keys=keys).wait().all_ok
        assert all(torch.equal(a, b) for a, b in zip(src, dst)) and not any(bad)
        moved = gds_kvikio.CuFile.moved
        assert [m[:2] for m in moved] == [("pwrite", "device")] * n + [("pread", "device")] * n
        assert sorted(m[2] for m in moved[n:]) == sorted(t.data_ptr() for t in dst)
        st = eng.stats()
        assert st["host_payload_bytes"] == 0 and st["host_fallback_blocks"] == 0 and st["gds"] is True
        eng.close_file(f)
    finally:
        eng.close()
    posix = PosixEngine(2)
    try:
        pf = posix.open(os.path.join(data_dir[0], "data.0"), dir_fd=data_dir[1])
        host = [torch.zeros(bb, dtype=torch.uint8) for _ in range(n)]
        assert posix.read(pf, offs, host, bb, expect=tags, codec=BlockCodec(b"s" * 32, 7), keys=keys).wait().all_ok
        assert all(torch.equal(a, b) for a, b in zip(src, host))
        posix.close_file(pf)
    finally:
        posix.close()


def test_gds_header_mismatch_is_a_miss_and_the_payload_is_never_read(gds_kvikio, data_dir):
    """A wrong key, a stale tag, another fingerprint or another secret: the header page (read on
    the host) fails, the block is bad, and its payload never reaches the device buffer."""
    bb, n = 8192, 4
    stride = slot_stride(bb)
    codec = BlockCodec(b"s" * 32, 7, device_sum=True)
    keys = [b"key%d" % i for i in range(n)]
    offs = [i * stride for i in range(n)]
    eng = KvikioEngine(2)
    try:
        f = _engine_file(eng, data_dir, n, stride)
        tags = [0] * n
        assert eng.write(f, offs, [_rand(bb, i) for i in range(n)], bb, checksums=tags, codec=codec,
                         keys=keys).wait().all_ok
        cases = [(codec, [b"other", *keys[1:]], tags, "misdirected"),
                 (codec, keys, [tags[0] ^ 1, *tags[1:]], "stale or swapped"),
                 (BlockCodec(b"s" * 32, 8, device_sum=True), keys, tags, "block of fingerprint"),
                 (BlockCodec(b"x" * 32, 7, device_sum=True), keys, tags, "tag does not verify")]
        for c, ks, ts, why in cases:
            gds_kvikio.CuFile.moved.clear()
            dst = [torch.zeros(bb, dtype=torch.uint8) for _ in range(n)]
            bad = [False] * n
            r = eng.read(f, offs, dst, bb, expect=ts, mismatched=bad, codec=c, keys=ks).wait()
            failed = [i for i in range(n) if not r.ok[i]]
            assert failed == [i for i in range(n) if bad[i]] and failed, why
            assert why in r.errors[0]
            read_into = {m[2] for m in gds_kvikio.CuFile.moved}
            assert all(dst[i].data_ptr() not in read_into and not dst[i].any() for i in failed)
        eng.close_file(f)
    finally:
        eng.close()


def test_gds_xxh3_block_is_read_through_the_host_verified_and_counted(gds_kvikio, data_dir, caplog):
    """A format-2 block (written by io: posix) read into device memory: read and verified on the
    host, then copied to the device (counted, logged once); a corrupt one never reaches it."""
    bb, n = 8192, 3
    stride = slot_stride(bb)
    keys = [b"key%d" % i for i in range(n)]
    offs = [i * stride for i in range(n)]
    src = [_rand(bb, 20 + i) for i in range(n)]
    posix = PosixEngine(2)
    try:
        pf = posix.open(os.path.join(data_dir[0], "data.0"), dir_fd=data_dir[1])
        os.posix_fallocate(pf.fd, 0, n * stride)
        tags = [0] * n
        assert posix.write(pf, offs, src, bb, checksums=tags, codec=BlockCodec(b"s" * 32, 7), keys=keys).wait().all_ok
        posix.close_file(pf)
    finally:
        posix.close()
    fd = os.open(os.path.join(data_dir[0], "data.0"), os.O_RDWR)     # buffered: the engine's fd is O_DIRECT
    try:
        assert struct.unpack_from("<H", os.pread(fd, 16, 0), 8)[0] == BLOCK_VERSION
        os.pwrite(fd, b"\x5a" if src[2][77] != 0x5A else b"\x00", offs[2] + ALIGN + 77)  # block 2 corrupt
    finally:
        os.close(fd)
    eng = KvikioEngine(2)
    try:
        f = eng.open(os.path.join(data_dir[0], "data.0"), dir_fd=data_dir[1])
        dst = [torch.zeros(bb, dtype=torch.uint8) for _ in range(n)]
        bad = [False] * n
        with caplog.at_level(logging.WARNING, logger="kvtier.nvme"):
            r = eng.read(f, offs, dst, bb, expect=tags, mismatched=bad, codec=BlockCodec(b"s" * 32, 7, device_sum=True),
                         keys=keys).wait()
        assert r.ok == [True, True, False] and bad == [False, False, True]
        assert torch.equal(dst[0], src[0]) and torch.equal(dst[1], src[1]) and not dst[2].any()
        assert gds_kvikio.CuFile.moved == []                         # none of it through kvikio
        st = eng.stats()
        assert st["host_fallback_blocks"] == 3 and st["host_payload_bytes"] == 3 * bb
        assert len([x for x in caplog.records if "format-2" in x.getMessage()]) == 1
        eng.close_file(f)
    finally:
        eng.close()


NB, H, BT, D = 8, 2, 16, 32


def _stack(tmp_path, kv_seed):
    """An NVMe data file on io: kvikio (the fake), a KV on CPU tensors driven by the device copier
    (`probes.DeferredStreams`: copies run later, as on a GPU), the executor between them."""
    g = torch.Generator().manual_seed(kv_seed)
    buf = torch.randn(2, NB, H, BT, D, generator=g)
    caches = {f"l{i}": buf[i] for i in range(2)}
    lay = KVLayout(caches, NB)
    bb = lay.block_bytes
    ctl = NvmeControl("nvme", str(tmp_path / "nvme"), 8, bb, EVICTION.get("lru")(8), {"model": "t"})
    data = NvmeData(ctl.dir, 8, bb, "kvikio", 2)
    pool = CpuPool(4, bb)
    kv = KVCopier(lay, pool, streams=probes.DeferredStreams())
    staging = Staging(bb, pin=False)
    ex = Executor(kv, [pool, data], bb, tier_names=["cpu", "nvme"], staging=staging)
    return caches, lay, ctl, data, pool, kv, staging, ex


def _block(caches, b):
    return torch.cat([probes.canonical(t, b) for t in caches.values()])


def test_gds_flipped_byte_is_a_miss_and_never_scattered(gds_kvikio, tmp_path):
    """file -> device staging rows -> verified there -> scattered into the KV: a block with one
    flipped payload byte is counted corrupt, a load error, and its KV block keeps its bytes; the
    others land byte-exact; no payload touched a host buffer (neither kvikio's nor staging)."""
    caches, lay, ctl, data, pool, kv, staging, ex = _stack(tmp_path, 0)
    try:
        assert data.device_reads and data.gds is True and kv.device_staging is not None
        ids, slots = [1, 2, 3, 4], [0, 1, 2, 3]
        keys = [b"k%d" % i for i in slots]
        want = [_block(caches, b).clone() for b in ids]
        w = data.write(slots, want, keys).wait()
        assert w.all_ok
        os.pwrite(data.file.fd, b"\xff" if want[2][5] != 0xFF else b"\x00", 2 * data.stride + ALIGN + 5)
        for b in range(NB):
            for t in caches.values():
                t[b].fill_(7.0)
        before = _block(caches, 6).clone()
        gds_kvikio.CuFile.moved.clear()
        dst = [5, 6, 0, 7]
        ex.load([LoadOp("r", 1, slots, dst, checksums=w.tags, keys=keys)])
        assert ex.take_load_errors() == {0}
        assert ex.counters.totals[Metric.CORRUPT_BLOCKS.at("nvme")] == 1
        assert torch.equal(_block(caches, 5), want[0]) and torch.equal(_block(caches, 6), want[1])
        assert torch.equal(_block(caches, 7), want[3])
        assert torch.equal(_block(caches, 0), before)                # the corrupt block: never scattered
        rows = kv.device_staging.rows()
        lo, hi = rows.data_ptr(), rows.data_ptr() + rows.numel()
        assert [m[:2] for m in gds_kvikio.CuFile.moved] == [("pread", "device")] * 4
        assert all(lo <= m[2] < hi for m in gds_kvikio.CuFile.moved)  # into the device staging rows
        assert data.engine.stats()["host_payload_bytes"] == 0
    finally:
        ex.close()
        data.close()
        ctl.close()
        pool.close()


def test_gds_encryption_with_kvikio_is_refused_in_one_line(gds_kvikio, tmp_path):
    cfg = {"block_bytes": 4096, "tiers": [
        {"name": "cpu", "kind": "cpu", "capacity_blocks": 8},
        {"name": "nvme", "kind": "nvme", "path": str(tmp_path / "n"), "capacity_blocks": 8, "io": "kvikio",
         "encryption": {"key_env": "KVTIER_TEST_KEY"}}]}
    with pytest.raises(ConfigError) as e:
        parse_config(cfg, "stack.yaml", check_env=False)
    msg = str(e.value)
    cause = [ln for ln in msg.splitlines() if "encryption" in ln]   # config errors: a header, a line per cause
    assert len(cause) == 1 and "tier 'nvme': encryption needs io: posix" in cause[0]
    ctl = NvmeControl("nvme", str(tmp_path / "nv"), 4, 4096, EVICTION.get("lru")(4), {"model": "t"})
    try:
        with pytest.raises(OSError) as e2:
            NvmeData(ctl.dir, 4, 4096, "kvikio", 2, sealer=Sealer(b"k" * 32))
        assert e2.value.errno == errno.EINVAL and "encryption needs io: posix" in str(e2.value)
        assert len(str(e2.value).splitlines()) == 1
    finally:
        ctl.close()


def test_gds_mode_is_in_the_start_line_and_metrics(gds_kvikio, monkeypatch):
    """kvikio's mode (GDS or compatibility) is named in the start line, and the worker's gauge is
    an exported Prometheus series."""
    from kvtier.connector import metrics
    from kvtier.connector.startup import _io_choice
    from kvtier.tiers import io_engines
    monkeypatch.setattr(io_engines, "cuda_driver_reason", lambda: None)
    nv = types.SimpleNamespace(io="kvikio", io_threads=4, direct="auto")
    assert "mode GDS" in _io_choice(nv, True, [])
    gds_kvikio.defaults = types.SimpleNamespace(get=lambda name: {"compat_mode": "ON"}[name])
    assert "mode compatibility" in _io_choice(nv, True, [])
    assert metrics.GAUGES["nvme_gds"] is Metric.NVME_GDS


def test_gds_worker_loads_nvme_into_device_staging_and_sets_the_gauge(gds_kvikio, tmp_path):
    """The worker on `nvme_io: kvikio` with the device copier (`probes.DeferredStreams`: copies run
    later, as on a GPU): blocks stored, copied down, then loaded without a DRAM slot read into the
    worker's device staging rows only, are verified there and land byte-exact; a flipped payload
    byte is a load error and its KV block keeps its bytes; `gauge_nvme_gds` is 1."""
    sys.path.insert(0, os.path.dirname(__file__))
    from parts_util import worker_settings
    from test_kv_layout import flash_caches
    from test_load_failures import Hooks
    from kvtier.connector.metadata import CopyOp, KVTierMetadata, LoadOp as MetaLoad, StoreOp
    from kvtier.connector.worker import KVTierWorker

    caches = flash_caches(blocks=12)
    orig = {n: t.clone() for n, t in caches.items()}
    st = probes.DeferredStreams()
    w = KVTierWorker(worker_settings(8, pin=False, nvme_write_lag_steps=0, nvme_io="kvikio"), copy_streams=st)
    w.register_kv_caches(caches)
    nv = dict(nvme_tier=1, nvme_dir=str(tmp_path / "nvme"), nvme_capacity=16)
    ctl = NvmeControl("nvme", nv["nvme_dir"], 16, w.layout.block_bytes, EVICTION.get("lru")(16))
    h = Hooks(w)
    try:
        keys = [b"k0", b"k1", b"k2"]
        h.step(KVTierMetadata(stores=[StoreOp(1, 0, [0, 1, 2], [1, 2, 3])],
                              copies=[CopyOp(2, [0, 1, 2], [10, 11, 12], keys)], **nv), [])
        st.drain()
        _, rep = h.step(KVTierMetadata(**nv), [])
        sums = rep.copied[2]
        assert len(sums) == 3 and min(sums) >= 0
        assert w.totals[Metric.NVME_GDS.key] == 1
        stride = slot_stride(w.layout.block_bytes)
        with open(w.nvme.path, "r+b") as f:                   # block 11's payload: one byte flipped
            f.seek(11 * stride + ALIGN + 3)
            b = f.read(1)
            f.seek(11 * stride + ALIGN + 3)
            f.write(bytes([b[0] ^ 0xFF]))
        for t in caches.values():
            t.zero_()
        gds_kvikio.CuFile.moved.clear()
        errors, _ = h.step(KVTierMetadata(loads=[MetaLoad("r", 1, [10, 11, 12], [6, 7, 8], sums, keys=keys)], **nv),
                           list(caches))
        st.drain()
        assert errors == {7}
        for n, t in caches.items():
            assert torch.equal(t[6], orig[n][1]) and torch.equal(t[8], orig[n][3]) and not t[7].any()
        rows = w.kv.device_staging.rows()
        lo, hi = rows.data_ptr(), rows.data_ptr() + rows.numel()
        assert [m[:2] for m in gds_kvikio.CuFile.moved] == [("pread", "device")] * 3
        assert all(lo <= m[2] < hi for m in gds_kvikio.CuFile.moved)
        assert w.nvme.engine.stats()["host_payload_bytes"] == 0
    finally:
        w.close()
        ctl.close()


# ---- stores device -> file: a stack whose top tier is NVMe (no DRAM tier) ----------------------------
def _nvme_top(tmp_path, kv_seed, io="kvikio"):
    """The controller over one NVMe tier (no DRAM tier: its stores go straight into the file) on
    `io`, a KV on CPU tensors driven by the device copier (`probes.DeferredStreams`), the executor
    between them (each counting into its own counters, as the connector's two sides do)."""
    from kvtier.core.controller import TierController
    from kvtier.tiers.nvme import NvmeTier
    g = torch.Generator().manual_seed(kv_seed)
    buf = torch.randn(2, NB, H, BT, D, generator=g)
    caches = {f"l{i}": buf[i] for i in range(2)}
    lay = KVLayout(caches, NB)
    bb = lay.block_bytes
    tier = NvmeTier("nvme", str(tmp_path / "nvme"), 8, bb, EVICTION.get("lru")(8), io=io, fingerprint={"model": "t"})
    pool = CpuPool(2, bb, pin=False)   # the copier's own; not a tier
    kv = KVCopier(lay, pool, streams=probes.DeferredStreams())
    ctrl = TierController([tier])
    ex = Executor(kv, [tier.data_plane], bb, tier_names=["nvme"], staging=Staging(bb, pin=False))
    return caches, tier, pool, kv, ctrl, ex


def _close(tier, pool, ex):
    ex.close()
    tier.close()
    pool.close()


def _round(ctrl, ex) -> set[int]:
    """Run the controller's plan through the executor and complete it; the load errors."""
    ctrl.complete(ex.run(ctrl.take_plan()))
    return ex.take_load_errors()


def _load(ctrl, ex, keys, dst) -> set[int]:
    lease = ctrl.acquire("r", keys)
    assert lease is not None
    ctrl.load("r", lease.num_blocks, dst)
    errors = _round(ctrl, ex)
    ctrl.release("r")
    return errors


def test_gds_store_with_no_dram_tier_goes_device_to_file_and_reads_back_verified(gds_kvikio, tmp_path, caplog):
    """A store into an NVMe top tier on io: kvikio: the KV blocks gathered into the device staging
    rows, each payload written from there (no host buffer, no host copy; format 4, its keyed sum
    computed on the device), flushed, then indexed with the tags the executor reported; loaded
    back file -> device staging -> KV byte-exact and verified. Counted per block, the path logged
    once for the tier."""
    caches, tier, pool, kv, ctrl, ex = _nvme_top(tmp_path, 1)
    try:
        ids, keys = [1, 2, 3, 4], [b"k%d" % i for i in range(6)]
        want = [_block(caches, b).clone() for b in ids + [5, 6]]
        gds_kvikio.CuFile.moved.clear()
        with caplog.at_level(logging.INFO, logger="kvtier.executor"):
            ctrl.store(keys[:4], ids)
            plan = ctrl.take_plan()
            assert [(op.tier, op.keys) for op in plan.stores] == [(0, keys[:4])] and not plan.copies
            ctrl.complete(ex.run(plan))
            ctrl.store(keys[4:], [5, 6])
            assert _round(ctrl, ex) == set()
        assert ctrl.lookup(keys) == 6
        rows = kv.device_staging.rows()
        lo, hi = rows.data_ptr(), rows.data_ptr() + rows.numel()
        moved = gds_kvikio.CuFile.moved
        assert [m[:2] for m in moved] == [("pwrite", "device")] * 6
        assert all(lo <= m[2] < hi for m in moved)                   # from the device staging rows
        st = tier.data.engine.stats()
        assert st["host_payload_bytes"] == 0 and st["host_fallback_blocks"] == 0
        for k in keys:
            assert struct.unpack_from("<H", os.pread(tier.data.file.fd, 16, tier.find(k) * tier.data.stride), 8)[0] \
                == DEVICE_VERSION
        totals = ex.counters.totals
        assert totals[Metric.DEVICE_STORED_BLOCKS.at("nvme")] == 6 and totals[Metric.BLOCKS_STORED.at("nvme")] == 6
        assert totals[Metric.BYTES_STORED.at("nvme")] == 6 * tier.block_bytes
        assert ctrl.totals[Metric.STORED_BLOCKS.at("nvme")] == 6    # committed: indexed
        said = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO and "stores into nvme" in r.getMessage()]
        assert len(said) == 1 and "device -> file" in said[0] and "GDS" in said[0]
        for t in caches.values():
            t.zero_()
        moved.clear()
        dst = [7, 0, 5, 6, 1, 2]
        assert _load(ctrl, ex, keys, dst) == set()
        assert all(torch.equal(_block(caches, b), w) for b, w in zip(dst, want))
        rows = kv.device_staging.rows()   # grown to 6 rows for the load
        lo, hi = rows.data_ptr(), rows.data_ptr() + rows.numel()
        assert [m[:2] for m in moved] == [("pread", "device")] * 6 and all(lo <= m[2] < hi for m in moved)
        assert tier.data.engine.stats()["host_payload_bytes"] == 0
    finally:
        _close(tier, pool, ex)


def test_gds_stored_block_with_a_flipped_byte_is_a_miss_and_counted(gds_kvikio, tmp_path):
    """A block stored device -> file whose payload has one flipped byte on disk: its load fails
    verification on the device, counted corrupt, a load error whose KV block keeps its bytes,
    quarantined (the next lookup ends before it); the others load byte-exact."""
    caches, tier, pool, kv, ctrl, ex = _nvme_top(tmp_path, 2)
    try:
        keys = [b"k%d" % i for i in range(4)]
        want = [_block(caches, b).clone() for b in (1, 2, 3, 4)]
        ctrl.store(keys, [1, 2, 3, 4])
        assert _round(ctrl, ex) == set() and ctrl.lookup(keys) == 4
        off = tier.find(keys[2]) * tier.data.stride + ALIGN + 5
        fd = os.open(tier.data.path, os.O_RDWR)
        try:
            os.pwrite(fd, bytes([os.pread(fd, 1, off)[0] ^ 0xFF]), off)
        finally:
            os.close(fd)
        for t in caches.values():
            t.fill_(3.0)
        before = _block(caches, 0).clone()
        assert _load(ctrl, ex, keys, [5, 6, 0, 7]) == {0}
        assert ctrl.totals[Metric.CORRUPT_BLOCKS.at("nvme")] == 1 and ex.counters.totals[Metric.CORRUPT_BLOCKS.at("nvme")] == 1
        assert torch.equal(_block(caches, 0), before)                # never scattered
        assert torch.equal(_block(caches, 5), want[0]) and torch.equal(_block(caches, 6), want[1])
        assert torch.equal(_block(caches, 7), want[3])
        assert ctrl.lookup(keys) == 2
    finally:
        _close(tier, pool, ex)


def test_gds_device_written_blocks_are_served_by_the_host_path_after_a_restart(gds_kvikio, tmp_path):
    """Blocks stored device -> file (format 4) and indexed; the directory reopened on io: posix:
    the host path (O_DIRECT into host buffers, the keyed sum checked on the host) serves every
    one byte-exact, none through kvikio."""
    from kvtier.core.stack import TierStack
    caches, tier, pool, kv, ctrl, ex = _nvme_top(tmp_path, 3)
    try:
        keys = [b"k%d" % i for i in range(5)]
        want = [_block(caches, b).clone() for b in (3, 1, 4, 6, 5)]
        ctrl.store(keys, [3, 1, 4, 6, 5])
        assert _round(ctrl, ex) == set()
    finally:
        _close(tier, pool, ex)
    cfg = parse_config({"block_bytes": want[0].numel(), "tiers": [
        {"name": "nvme", "kind": "nvme", "path": str(tmp_path / "nvme"), "capacity_blocks": 8, "io": "posix"}]},
        "t", check_env=False)
    gds_kvikio.CuFile.moved.clear()
    with TierStack.from_config(cfg, fingerprint={"model": "t"}) as stack:
        assert stack.tiers[0].restored_blocks == 5 and "posix" in stack.tiers[0].data.description
        dst = [torch.zeros_like(w) for w in want]
        assert stack.get(keys, dst) == 5
        assert all(torch.equal(a, b) for a, b in zip(dst, want))
    assert gds_kvikio.CuFile.moved == []


def test_gds_store_paths_where_they_are_not_device_to_file(gds_kvikio, tmp_path):
    """Where a store does not go device -> file: on io: posix (the engine moves host memory) an
    NVMe top tier's store gathers into host staging rows and writes host -> file; with a DRAM tier
    above NVMe (every stack of the connector) the store lands in DRAM and the copy down writes the
    DRAM slot, host -> file, even on io: kvikio. Neither counts device_stored_blocks."""
    caches, tier, pool, kv, ctrl, ex = _nvme_top(tmp_path, 4, io="posix")
    try:
        keys = [b"k%d" % i for i in range(3)]
        want = [_block(caches, b).clone() for b in (1, 2, 3)]
        ctrl.store(keys, [1, 2, 3])
        assert _round(ctrl, ex) == set() and ctrl.lookup(keys) == 3
        assert ctrl.totals[Metric.STORED_BLOCKS.at("nvme")] == 3 and ex.counters.totals[Metric.BLOCKS_STORED.at("nvme")] == 3
        assert Metric.DEVICE_STORED_BLOCKS.at("nvme") not in ex.counters.totals
        for t in caches.values():
            t.zero_()
        assert _load(ctrl, ex, keys, [4, 5, 6]) == set()
        assert all(torch.equal(_block(caches, b), w) for b, w in zip((4, 5, 6), want))
    finally:
        _close(tier, pool, ex)
    caches, lay, ctl, data, pool, kv, staging, ex = _stack(tmp_path / "dram", 5)   # cpu, nvme on io: kvikio
    try:
        from kvtier.core.plan import CopyOp, StoreOp
        gds_kvikio.CuFile.moved.clear()
        keys = [b"d%d" % i for i in range(2)]
        ex.run(Plan(stores=[StoreOp(1, 0, [0, 1], [1, 2])], copies=[CopyOp(2, [0, 1], [0, 1], keys)]))
        moved = gds_kvikio.CuFile.moved   # (CPU tensors pose as device memory here: told apart by address)
        lo, hi = pool.buffer.data_ptr(), pool.buffer.data_ptr() + pool.buffer.numel()
        assert [m[0] for m in moved] == ["pwrite"] * 2 and all(lo <= m[2] < hi for m in moved)   # the DRAM slots
        assert Metric.DEVICE_STORED_BLOCKS.at("nvme") not in ex.counters.totals
    finally:
        ex.close()
        data.close()
        ctl.close()
        pool.close()


def test_gds_failed_device_write_is_not_indexed_and_is_counted(gds_kvikio, tmp_path, caplog, monkeypatch):
    """kvikio fails one block's device -> file write (EIO): that block is not committed (counted in
    store_failed_blocks and the engine's io_errors, logged once), its slot released, a later
    lookup misses it; the op's other blocks are indexed and load byte-exact."""
    caches, tier, pool, kv, ctrl, ex = _nvme_top(tmp_path, 6)
    try:
        keys = [b"k%d" % i for i in range(3)]
        want = [_block(caches, b).clone() for b in (1, 2, 3)]
        real = gds_kvikio.CuFile.pwrite
        bad_off = {}

        def pwrite(self, buf, size, file_offset=0, task_size=None):
            if file_offset == bad_off.get("at"):
                raise RuntimeError(f"KvikIO failure at: /src/posix_io.cpp:42: {os.strerror(errno.EIO)}")
            return real(self, buf, size, file_offset, task_size)
        monkeypatch.setattr(gds_kvikio.CuFile, "pwrite", pwrite)
        ctrl.store(keys, [1, 2, 3])
        plan = ctrl.take_plan()
        bad_off["at"] = plan.stores[0].slots[1] * tier.data.stride + ALIGN
        with caplog.at_level(logging.ERROR):
            ctrl.complete(ex.run(plan))
        assert ctrl.totals[Metric.STORE_FAILED_BLOCKS.at("nvme")] == 1
        assert ctrl.totals[Metric.STORED_BLOCKS.at("nvme")] == 2 and tier.data.engine.stats()["io_errors"] == 1
        assert [tier.find(k) is not None for k in keys] == [True, False, True]
        said = [r.getMessage() for r in caplog.records if "stored into nvme failed" in r.getMessage()]
        assert len(said) == 1 and "Input/output error" in said[0]
        for t in caches.values():
            t.zero_()
        assert _load(ctrl, ex, keys[2:], [6]) == set() and torch.equal(_block(caches, 6), want[2])
        assert ctrl.lookup(keys) == 1
    finally:
        _close(tier, pool, ex)


@pytest.mark.parametrize("io", ["posix", "kvikio"])
def test_gds_nvme_only_stack_puts_from_the_callers_tensors(gds_kvikio, tmp_path, io):
    """`TierStack.put` into `tiers: [nvme]` (no DRAM tier): each block written from the caller's
    own tensor (on io: kvikio a device tensor goes device -> file from its own memory, no staging
    copy), flushed and indexed; `get` serves them byte-exact, after a restart too."""
    from kvtier.core.stack import TierStack
    bb = 8192
    cfg = parse_config({"block_bytes": bb, "tiers": [
        {"name": "nvme", "kind": "nvme", "path": str(tmp_path / "n"), "capacity_blocks": 8, "io": io}]},
        "t", check_env=False)
    keys = [b"p%d" % i for i in range(4)]
    srcs = [_rand(bb, 40 + i) for i in range(4)]
    gds_kvikio.CuFile.moved.clear()
    with TierStack.from_config(cfg, fingerprint={"model": "t"}) as stack:
        assert stack.put(keys, srcs) == 4
        assert stack.metrics.stored == {"nvme": 4}
    moved = gds_kvikio.CuFile.moved
    if io == "kvikio":
        assert sorted(m[:3] for m in moved) == sorted(("pwrite", "device", t.data_ptr()) for t in srcs)
    else:
        assert moved == []
    with TierStack.from_config(cfg, fingerprint={"model": "t"}) as stack:
        dst = [torch.zeros(bb, dtype=torch.uint8) for _ in keys]
        assert stack.get(keys, dst) == 4 and all(torch.equal(a, b) for a, b in zip(dst, srcs))


def test_gds_store_whose_write_handle_raises_fails_only_that_op(gds_kvikio, tmp_path, monkeypatch):
    """An engine whose handle raises when waited for (a thread's exception, not a per-block
    result) fails that store op, counted and not indexed; `Executor.store` never raises, and the
    next store writes and indexes."""
    from kvtier.tiers.io_engine import IOHandle

    class Raising(IOHandle):
        def done(self) -> bool:
            return True

        def wait(self, timeout=None):
            raise RuntimeError("an I/O thread died")
    caches, tier, pool, kv, ctrl, ex = _nvme_top(tmp_path, 7)
    try:
        plane = tier.data_plane
        real = plane.write
        monkeypatch.setattr(plane, "write", lambda *a, **k: Raising())
        ctrl.store([b"a", b"b"], [1, 2])
        ctrl.complete(ex.run(ctrl.take_plan()))
        assert ctrl.totals[Metric.STORE_FAILED_BLOCKS.at("nvme")] == 2
        assert [tier.find(k) for k in (b"a", b"b")] == [None, None]
        monkeypatch.setattr(plane, "write", real)
        ctrl.store([b"c"], [3])
        ctrl.complete(ex.run(ctrl.take_plan()))
        assert ctrl.totals[Metric.STORED_BLOCKS.at("nvme")] == 1 and tier.find(b"c") is not None
    finally:
        _close(tier, pool, ex)
