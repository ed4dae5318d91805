"""I/O engines: coalescing, bounce buffers, checksums, engine selection, kvikio on host buffers."""

from __future__ import annotations

import errno
import logging
import mmap
import os
import subprocess
import sys
import types

import pytest
import torch
import xxhash

from kvtier.tiers import io_kvikio
from kvtier.tiers.cpu_pool import CpuPool
from kvtier.tiers.io_engine import HOOKS
from kvtier.tiers.io_engines import (AUTO_HOST_REASON, KVIKIO_HOST_NOTE, ALIGN, EngineUnavailable, KvikioEngine,
                                     PosixEngine, cuda_driver_reason, select_engine)
from kvtier.tiers.nvme_block import BlockCodec, UnsafePath


def aligned(n: int) -> torch.Tensor:
    mm = mmap.mmap(-1, n)
    t = torch.frombuffer(mm, dtype=torch.uint8)
    t._mm = mm  # keep the mapping alive with the tensor
    return t


@pytest.fixture
def eng():
    e = PosixEngine(threads=3, max_io_bytes=64 * 1024)
    yield e
    e.close()


def test_coalesced_writes_reads_and_checksums(tmp_path, eng):
    f = eng.open(str(tmp_path / "d"))
    os.posix_fallocate(f.fd, 0, 64 * 16384)
    n, bb = 24, 16384
    region = aligned(n * bb)
    region.copy_(torch.randint(0, 256, (n * bb,), dtype=torch.uint8))
    bufs = list(region.view(n, bb).unbind(0))
    slots = list(range(10, 34))                         # contiguous in the file
    sums = [0] * n
    res = eng.write(f, [s * bb for s in slots], bufs, bb, checksums=sums).wait()
    assert res.ok == [True] * n and res.nbytes == n * bb
    assert sums == [xxhash.xxh3_64_intdigest(memoryview(b.numpy())) for b in bufs]
    # 24 blocks x 16 KiB = 384 KiB in runs of <= 64 KiB: exactly 6 syscalls, no bounce
    assert eng.syscalls == 6 and eng.bounced_blocks == 0
    with open(f.path, "rb") as fh:
        fh.seek(10 * bb)
        assert fh.read(n * bb) == bytes(region.numpy())
    out = aligned(n * bb)
    outs = list(out.view(n, bb).unbind(0))
    order = list(reversed(range(n)))                    # submission order != file order
    bad = [False] * n
    res = eng.read(f, [slots[i] * bb for i in order], [outs[i] for i in order], bb,
                   expect=[sums[i] for i in order], mismatched=bad).wait()
    assert res.all_ok and not any(bad)
    assert torch.equal(out, region)
    eng.close_file(f)


def test_read_mismatch_flags_exact_blocks(tmp_path, eng):
    f = eng.open(str(tmp_path / "d"))
    bb = 5000                                           # padded to 8192 per slot, bounced
    os.posix_fallocate(f.fd, 0, 8 * 8192)
    bufs = [torch.full((bb,), i, dtype=torch.uint8) for i in range(8)]
    sums = [0] * 8
    assert eng.write(f, [i * 8192 for i in range(8)], bufs, bb, checksums=sums).wait().all_ok
    assert eng.bounced_blocks == 8
    sums[2] ^= 1
    sums[5] ^= 1
    outs = [torch.zeros(bb, dtype=torch.uint8) for _ in range(8)]
    bad = [False] * 8
    res = eng.read(f, [i * 8192 for i in range(8)], outs, bb, expect=sums, mismatched=bad).wait()
    assert res.ok == [i not in (2, 5) for i in range(8)] and bad == [i in (2, 5) for i in range(8)]
    assert len(res.errors) == 2 and "checksum mismatch" in res.errors[0]
    assert all(torch.equal(outs[i], bufs[i]) for i in range(8) if i not in (2, 5))
    assert all(int(outs[i].sum()) == 0 for i in (2, 5))  # bounced bad bytes are not handed out
    eng.close_file(f)


def test_io_error_reported_per_block(tmp_path, eng):
    f = eng.open(str(tmp_path / "d"))
    os.posix_fallocate(f.fd, 0, 2 * ALIGN)
    outs = [aligned(ALIGN) for _ in range(2)]
    res = eng.read(f, [0, 10 * ALIGN], outs, ALIGN).wait()  # second is past EOF
    assert res.ok == [True, False] and "short read" in res.errors[0]
    assert eng.stats()["io_errors"] == 1
    eng.close_file(f)


def test_failed_batches_log_one_line_per_cause_and_count_all(tmp_path, eng, monkeypatch, caplog):
    """A full disk fails every step: each cause (operation, errno, file) is one ERROR line, its
    repeats are DEBUG lines, and every failed batch is counted in io_errors."""
    full = eng.open(str(tmp_path / "full"))
    short = eng.open(str(tmp_path / "short"))
    other = eng.open(str(tmp_path / "other"))
    for f in (full, short, other):
        os.posix_fallocate(f.fd, 0, 2 * ALIGN)
    monkeypatch.setattr(HOOKS, "fault", ("write", "ENOSPC", 1))   # every data write: no space
    monkeypatch.setattr(HOOKS, "counts", {})
    buf = [aligned(ALIGN)]
    with caplog.at_level(logging.DEBUG, logger="kvtier.nvme"):
        for _ in range(5):                                        # one block: one batch per call
            assert eng.write(full, [0], buf, ALIGN).wait().ok == [False]
        for _ in range(3):                                        # past EOF: a real short read (EIO)
            assert eng.read(short, [8 * ALIGN], buf, ALIGN).wait().ok == [False]
        assert eng.write(other, [0], buf, ALIGN).wait().ok == [False]   # the same errno, another file
    recs = [r for r in caplog.records if r.getMessage().startswith("nvme io:")]
    errors = [r.getMessage() for r in recs if r.levelno == logging.ERROR]
    assert len(errors) == 3
    assert "write of 1 blocks" in errors[0] and "[ENOSPC]" in errors[0] and full.path in errors[0]
    assert "read of 1 blocks" in errors[1] and "[EIO]" in errors[1] and short.path in errors[1]
    assert "[ENOSPC]" in errors[2] and other.path in errors[2]
    assert [r.levelno for r in recs].count(logging.DEBUG) == 4 + 2
    assert eng.stats()["io_errors"] == 5 + 3 + 1
    for f in (full, short, other):
        eng.close_file(f)


def test_unaligned_offset_rejected(tmp_path, eng):
    f = eng.open(str(tmp_path / "d"))
    with pytest.raises(ValueError, match="not 4096-aligned"):
        eng.write(f, [100], [aligned(ALIGN)], ALIGN)
    with pytest.raises(ValueError, match="holds 10 bytes"):
        eng.write(f, [0], [torch.zeros(10, dtype=torch.uint8)], ALIGN)
    eng.close_file(f)


def test_bad_engine_args():
    with pytest.raises(ValueError, match="io_threads"):
        PosixEngine(threads=0)
    with pytest.raises(ValueError, match="max_io_bytes"):
        PosixEngine(max_io_bytes=1000)
    with pytest.raises(ValueError, match="io must be"):
        select_engine("spdk")
    with pytest.raises(ValueError, match="buffers must be"):
        select_engine("auto", buffers="gpu")


def test_select_engine_without_cuda():
    if cuda_driver_reason() is not None:
        eng, reason = select_engine("auto", buffers="device")
        assert isinstance(eng, PosixEngine) and "no CUDA driver" in reason
        eng.close()
        with pytest.raises(EngineUnavailable, match="no CUDA driver"):
            select_engine("kvikio")
    eng, reason = select_engine("auto")
    assert isinstance(eng, PosixEngine) and reason == AUTO_HOST_REASON
    eng.close()
    eng, reason = select_engine("posix")
    assert reason == "io=posix asked"
    eng.close()


def test_kvikio_is_imported_only_when_used():
    """Importing the engines and picking 'auto' or 'posix' for host buffers never imports kvikio."""
    code = ("import sys; from kvtier.tiers.io_engines import select_engine\n"
            "for io in ('auto', 'posix'):\n    select_engine(io)[0].close()\n"
            "assert 'kvikio' not in sys.modules, 'kvikio imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


# ---- kvikio on host buffers ------------------------------------------------------------------
# The worker's NVMe I/O always moves host memory (CPU pool slots, staging rows). A fake kvikio
# (`fake_kvikio`, always) and the real one where it is installed (`real_kvikio`: it imports without
# a GPU, but every transfer then fails) check what runs here; the GPU tests check the rest.

def _make_fake_kvikio():
    """A stand-in for the `kvikio` module: CuFile opens its path with open(2) and moves host memory
    through the buffer protocol (a torch CPU tensor is refused with TypeError, as kvikio does);
    `CuFile.fail[op] = errno` makes every `op` fail the way kvikio reports it (RuntimeError)."""

    class Future:
        def __init__(self, n):
            self.n = n

        def get(self):
            return self.n

    class CuFile:
        opened: list[str] = []
        fail: dict[str, int] = {}

        def __init__(self, path, flags="r"):
            self._fd = os.open(path, {"r": os.O_RDONLY, "r+": os.O_RDWR}[flags] | os.O_CLOEXEC)
            CuFile.opened.append(str(path))

        def fileno(self):
            return self._fd

        def close(self):
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

        def _mv(self, op, buf, size):
            mv = memoryview(buf).cast("B")  # TypeError for a torch tensor: no buffer protocol
            if op in CuFile.fail:
                raise RuntimeError(f"KvikIO failure at: /src/posix_io.cpp:42: {os.strerror(CuFile.fail[op])}")
            return mv[:size]

        def pread(self, buf, size, file_offset=0, task_size=None):
            mv = self._mv("pread", buf, size)
            return Future(os.preadv(self._fd, [mv], file_offset))

        def pwrite(self, buf, size, file_offset=0, task_size=None):
            mv = self._mv("pwrite", buf, size)
            return Future(os.pwrite(self._fd, mv, file_offset))

    mod = types.ModuleType("kvikio")
    mod.__version__ = "0.0-fake"
    mod.CuFile = CuFile
    mod.defaults = types.SimpleNamespace(get=lambda name: {"compat_mode": "ON"}[name])
    return mod


@pytest.fixture
def fake_kvikio(monkeypatch):
    mod = _make_fake_kvikio()
    monkeypatch.setitem(sys.modules, "kvikio", mod)
    monkeypatch.setattr(io_kvikio, "cuda_driver_reason", lambda: None)  # as on a machine with a driver
    return mod


@pytest.fixture
def real_kvikio(monkeypatch):
    """The installed kvikio on a machine without a CUDA driver, past kvtier's driver guard."""
    mod = pytest.importorskip("kvikio")
    if cuda_driver_reason() is None:
        pytest.skip("a CUDA driver is present: kvikio's transfers work here")
    monkeypatch.setattr(io_kvikio, "cuda_driver_reason", lambda: None)
    return mod


@pytest.fixture(params=["fake", "real"])
def any_kvikio(request):
    return request.getfixturevalue(f"{request.param}_kvikio")


@pytest.fixture
def data_dir(tmp_path):
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    yield str(tmp_path), fd
    os.close(fd)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_auto_never_picks_kvikio_for_host_buffers(any_kvikio):
    """Even where kvikio would run, 'auto' for the NVMe tier's host buffers is POSIX, and says why."""
    eng, reason = select_engine("auto")
    assert isinstance(eng, PosixEngine) and reason == AUTO_HOST_REASON
    assert "host buffers" in reason and "POSIX" in reason
    eng.close()
    eng, reason = select_engine("auto", buffers="device")   # a caller moving CUDA memory gets kvikio
    assert isinstance(eng, KvikioEngine) and "host" not in reason
    eng.close()
    eng, reason = select_engine("kvikio")                   # asked for: it runs, and the reason says what it is
    assert isinstance(eng, KvikioEngine) and reason.endswith(KVIKIO_HOST_NOTE)
    eng.close()


def test_kvikio_opens_the_file_kvtier_checked(any_kvikio, data_dir, monkeypatch):
    path, dfd = data_dir
    eng = KvikioEngine(2)
    try:
        f = eng.open(os.path.join(path, "data.0"), dir_fd=dfd)
        a, b = os.fstat(f.fd), os.fstat(f.handle.fileno())
        assert (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
        if any_kvikio.__version__.endswith("fake"):  # kvikio was handed our descriptor's magic link
            assert any_kvikio.CuFile.opened == [f"/proc/self/fd/{f.fd}"]
        eng.close_file(f)
        # a symlink planted as the data file is refused before kvikio sees it
        os.symlink(os.path.join(path, "elsewhere"), os.path.join(path, "data.1"))
        with pytest.raises(UnsafePath, match="symlink"):
            eng.open(os.path.join(path, "data.1"), dir_fd=dfd)
        # a file swapped in between kvtier's open and kvikio's is refused, nothing left open
        decoy = os.path.join(path, "decoy")
        open(decoy, "wb").close()
        monkeypatch.setattr(io_kvikio, "_reopen_path", lambda fd, p: decoy)
        before = _open_fds()
        with pytest.raises(UnsafePath, match="another file than the one kvtier checked"):
            eng.open(os.path.join(path, "data.0"), dir_fd=dfd)
        assert _open_fds() == before
    finally:
        eng.close()


def _blocks(n: int, bb: int, seed: int) -> CpuPool:
    pool = CpuPool(n, bb, pin=False)
    g = torch.Generator().manual_seed(seed)
    pool.buffer.copy_(torch.randint(0, 256, (n * bb,), dtype=torch.uint8, generator=g))
    return pool


def test_kvikio_host_buffer_round_trip(fake_kvikio, data_dir):
    """CPU pool views (torch CPU tensors, as the worker passes them) go through kvikio byte-exact,
    keyed and checksummed; a corrupt block is flagged, not handed out as good."""
    path, dfd = data_dir
    bb, n = 12288, 4
    stride = ALIGN + bb
    eng = KvikioEngine(2)
    src, dst = _blocks(n, bb, 1), _blocks(n, bb, 2)
    codec = BlockCodec(b"s" * 32, 7)
    keys = [b"key%d" % i for i in range(n)]
    try:
        f = eng.open(os.path.join(path, "data.0"), dir_fd=dfd)
        os.posix_fallocate(f.fd, 0, n * stride)
        offs = [i * stride for i in range(n)]
        tags = [0] * n
        assert eng.write(f, offs, src.views, bb, checksums=tags, codec=codec, keys=keys).wait().all_ok
        bad = [False] * n
        assert eng.read(f, offs, dst.views, bb, expect=tags, mismatched=bad, codec=codec, keys=keys).wait().all_ok
        assert torch.equal(dst.buffer, src.buffer) and not any(bad)
        os.pwrite(f.fd, b"\xff", offs[2] + ALIGN + 100)             # one payload byte of block 2
        res = eng.read(f, offs, dst.views, bb, expect=tags, mismatched=bad, codec=codec, keys=keys).wait()
        assert res.ok == [True, True, False, True] and bad == [False, False, True, False]
        assert "fails verification" in res.errors[0]
        sums = [0] * n                                               # plain checksummed blocks
        assert eng.write(f, offs, src.views, bb, checksums=sums).wait().all_ok
        assert sums == [xxhash.xxh3_64_intdigest(memoryview(v.numpy())) for v in src.views]
        assert eng.stats()["io_errors"] == 0
        with pytest.raises(ValueError, match="not contiguous"):
            eng.write(f, offs[:1], [src.buffer.view(bb, n).t()[0]], bb)
        eng.close_file(f)
    finally:
        eng.close()
        src.close()
        dst.close()


def test_kvikio_errors_are_logged_once_per_kind_and_counted(fake_kvikio, data_dir, caplog):
    path, dfd = data_dir
    bb, n = 8192, 3
    eng = KvikioEngine(2)
    pool = _blocks(n, bb, 3)
    try:
        f = eng.open(os.path.join(path, "data.0"), dir_fd=dfd)
        os.posix_fallocate(f.fd, 0, n * bb)
        offs = [i * bb for i in range(n)]
        fake_kvikio.CuFile.fail["pread"] = errno.EIO
        with caplog.at_level(logging.ERROR, logger="kvtier.nvme"):
            for _ in range(2):
                res = eng.read(f, offs, pool.views, bb).wait()
                assert res.ok == [False] * n and all(f.path in e for e in res.errors)
            fake_kvikio.CuFile.fail = {"pwrite": errno.ENOSPC}
            assert eng.write(f, offs, pool.views, bb).wait().ok == [False] * n
        logged = [r.getMessage() for r in caplog.records if "kvikio" in r.getMessage()]
        assert len(logged) == 2                                      # one line per kind
        assert "kvikio read" in logged[0] and f.path in logged[0] and "EIO" in logged[0]
        assert "kvikio write" in logged[1] and "ENOSPC" in logged[1]
        st = eng.stats()
        assert st["io_errors"] == 3 * n
        assert st["io_error_kinds"] == {"read RuntimeError [EIO]: Input/output error": 2 * n,
                                        "write RuntimeError [ENOSPC]: No space left on device": n}
        eng.close_file(f)
    finally:
        eng.close()
        pool.close()


def test_real_kvikio_without_a_driver_fails_loudly(real_kvikio, data_dir, caplog):
    """kvikio imports without a GPU but every transfer fails (libcuda.so.1 missing): each failure is
    a not-ok block and a count, the first of each kind a log line naming the file."""
    path, dfd = data_dir
    bb = 8192
    eng = KvikioEngine(2)
    pool = _blocks(2, bb, 4)
    try:
        f = eng.open(os.path.join(path, "data.0"), dir_fd=dfd)
        os.posix_fallocate(f.fd, 0, 2 * bb)
        with caplog.at_level(logging.ERROR, logger="kvtier.nvme"):
            assert eng.write(f, [0, bb], pool.views, bb, checksums=[0, 0]).wait().ok == [False, False]
            assert eng.read(f, [0, bb], pool.views, bb).wait().ok == [False, False]
        logged = [r.getMessage() for r in caplog.records if "kvikio" in r.getMessage()]
        assert len(logged) == 2 and all("libcuda.so.1" in m and f.path in m for m in logged)
        assert "TypeError" not in "".join(logged)                    # host memory reached kvikio
        st = eng.stats()
        assert st["io_errors"] == 4 and sum(st["io_error_kinds"].values()) == 4
        eng.close_file(f)
    finally:
        eng.close()
        pool.close()


# ---- on a GPU machine ------------------------------------------------------------------------
def _gpu_kvikio_or_skip():
    if cuda_driver_reason() is not None or not torch.cuda.is_available():
        pytest.skip(cuda_driver_reason() or "needs CUDA")
    pytest.importorskip("kvikio")


@pytest.mark.gpu
def test_kvikio_host_buffer_round_trip_gpu(data_dir):  # pragma: no cover - GPU only
    """What the worker does: pinned CPU pool slots to the file through kvikio and back, keyed."""
    _gpu_kvikio_or_skip()
    path, dfd = data_dir
    bb, n = 65536, 4
    stride = ALIGN + bb
    eng, reason = select_engine("kvikio")
    assert isinstance(eng, KvikioEngine) and KVIKIO_HOST_NOTE in reason
    src = CpuPool(n, bb, pin=True)
    dst = CpuPool(n, bb, pin=True)
    assert src.pinned and dst.pinned
    src.buffer.copy_(torch.randint(0, 256, (n * bb,), dtype=torch.uint8))
    codec = BlockCodec(b"g" * 32, 1)
    keys = [b"gk%d" % i for i in range(n)]
    try:
        f = eng.open(os.path.join(path, "data.0"), dir_fd=dfd)
        os.posix_fallocate(f.fd, 0, n * stride)
        offs = [i * stride for i in range(n)]
        tags = [0] * n
        assert eng.write(f, offs, src.views, bb, checksums=tags, codec=codec, keys=keys).wait().all_ok
        assert eng.read(f, offs, dst.views, bb, expect=tags, codec=codec, keys=keys).wait().all_ok
        assert torch.equal(dst.buffer, src.buffer) and eng.stats()["io_errors"] == 0
        eng.close_file(f)
    finally:
        eng.close()
        src.close()
        dst.close()


@pytest.mark.gpu
def test_kvikio_device_round_trip_gpu(data_dir):  # pragma: no cover - GPU only
    """CUDA tensors (not what the worker passes; 'auto' picks kvikio only for these)."""
    _gpu_kvikio_or_skip()
    path, dfd = data_dir
    eng, _ = select_engine("auto", buffers="device")
    assert isinstance(eng, KvikioEngine)
    try:
        f = eng.open(os.path.join(path, "data.0"), dir_fd=dfd)
        os.posix_fallocate(f.fd, 0, 4 * 65536)
        src = [torch.randint(0, 256, (65536,), dtype=torch.uint8, device="cuda") for _ in range(4)]
        sums = [0] * 4
        assert eng.write(f, [i * 65536 for i in range(4)], src, 65536, checksums=sums).wait().all_ok
        dst = [torch.empty(65536, dtype=torch.uint8, device="cuda") for _ in range(4)]
        assert eng.read(f, [i * 65536 for i in range(4)], dst, 65536, expect=sums).wait().all_ok
        assert all(torch.equal(a, b) for a, b in zip(src, dst))
        eng.close_file(f)
    finally:
        eng.close()
