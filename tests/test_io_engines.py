"""I/O engines: coalescing, bounce buffers, checksums, engine selection."""

from __future__ import annotations

import mmap
import os

import pytest
import torch
import xxhash

from kvtier.tiers import io_engines as ioe
from kvtier.tiers.io_engines import ALIGN, EngineUnavailable, PosixEngine, cuda_driver_reason, select_engine


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


def test_select_engine_without_cuda():
    if cuda_driver_reason() is None:
        pytest.skip("a CUDA driver is present here")
    eng, reason = select_engine("auto")
    try:
        assert isinstance(eng, PosixEngine) and "no CUDA driver" in reason
    finally:
        eng.close()
    with pytest.raises(EngineUnavailable, match="no CUDA driver"):
        select_engine("kvikio")
    eng, reason = select_engine("posix")
    assert reason == "io=posix asked"
    eng.close()


def test_kvikio_round_trip_gpu(tmp_path):
    if cuda_driver_reason() is not None:
        pytest.skip(cuda_driver_reason())
    pytest.importorskip("kvikio")
    eng, _ = select_engine("kvikio")
    try:
        f = eng.open(str(tmp_path / "d"))
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


def test_module_imports_without_kvikio():
    import sys
    assert "kvikio" not in sys.modules or cuda_driver_reason() is None
    assert ioe.KvikioEngine.name == "kvikio"
