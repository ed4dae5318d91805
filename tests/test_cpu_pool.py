"""Host memory: anonymous mappings pinned by chunks (cudaHostRegister) with a pageable fallback.

The CUDA calls go through `cpu_pool.CUDA`; here a fake stands in for it (the chunk plan, the
fallback, the cleanup, the `pinned` flag), and the GPU tests run the real one.
"""

from __future__ import annotations

import gc
import logging
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.core.staging import Staging
from kvtier.tiers import cpu_pool as cp
from kvtier.tiers.cpu_pool import PAGE, CpuPool, CudaHostRegistry, HostBuffer, host_buffer, host_memory_stats

MiB = 1 << 20


class FakeCuda:
    """Records register/unregister calls and what is registered now; refuses overlaps."""

    def __init__(self) -> None:
        self.fail_at: set[int] = set()                   # register calls (0-based) that fail / raise
        self.raise_at: set[int] = set()
        self.fail_unregister = False
        self.registered: dict[int, int] = {}   # address -> size, currently registered
        self.calls: list[tuple] = []

    def register(self, ptr: int, size: int) -> str | None:
        k = sum(1 for c in self.calls if c[0] == "register")
        self.calls.append(("register", ptr, size))
        if k in self.raise_at:
            raise RuntimeError("no cudart")
        if k in self.fail_at:
            return "cudaHostRegister: CUDA error 2 (out of memory)"
        assert not any(p < ptr + size and ptr < p + n for p, n in self.registered.items()), "overlap"
        self.registered[ptr] = size
        return None

    def unregister(self, ptr: int) -> str | None:
        self.calls.append(("unregister", ptr))
        assert ptr in self.registered, "unregistering what was never registered"
        del self.registered[ptr]
        return "cudaHostUnregister: CUDA error 1 (invalid argument)" if self.fail_unregister else None


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = FakeCuda()
    monkeypatch.setattr(cp, "CUDA", fake)
    monkeypatch.setattr(cp, "cuda_available", lambda: True)
    monkeypatch.setattr(cp, "_warned", set())
    return fake


def _unit(row: int) -> int:
    return math.lcm(row, PAGE)


@settings(max_examples=200, deadline=None)
@given(pages=st.integers(1, 5000), row=st.integers(1, 1 << 20), chunk_pages=st.integers(1, 3000))
def test_register_plan_covers_the_mapping_on_row_and_page_boundaries(pages, row, chunk_pages):
    nbytes, chunk = pages * PAGE, chunk_pages * PAGE
    plan = cp.register_plan(nbytes, row, chunk)
    assert plan[0][0] == 0 and sum(n for _, n in plan) == nbytes
    assert all(o2 == o1 + n1 for (o1, n1), (o2, _) in zip(plan, plan[1:]))    # contiguous, no overlap
    assert all(o % _unit(row) == 0 for o, _ in plan)                          # starts on a row and a page
    assert all(n <= max(chunk, _unit(row)) for _, n in plan)
    assert len(plan) == -(-nbytes // max(_unit(row), chunk // _unit(row) * _unit(row)))


def test_pool_is_registered_in_chunks_and_unregistered_at_close(fake_cuda, monkeypatch):
    monkeypatch.setattr(cp, "REGISTER_CHUNK_BYTES", 4 * MiB)
    bb = 3 * 65536                                      # rows of 192 KiB: chunks of 21 rows (4032 KiB)
    before = host_memory_stats()["pinned_bytes"]
    pool = CpuPool(64, bb, pin="auto")
    base, size = pool.buffer.data_ptr(), 64 * bb
    assert pool.pinned and pool.host.pinned
    step = 4 * MiB // bb * bb
    want = [(base + o, min(step, size - o)) for o in range(0, size, step)]
    assert [c[1:] for c in fake_cuda.calls] == want and len(want) == 4
    assert host_memory_stats()["pinned_bytes"] == before + size
    pool.write([5], [torch.full((bb,), 7, dtype=torch.uint8)])      # the memory works as before
    out = torch.zeros(bb, dtype=torch.uint8)
    pool.read([5], [out])
    assert int(out.min()) == int(out.max()) == 7
    pool.close()
    assert fake_cuda.calls[4:] == [("unregister", p) for p, _ in reversed(want)]
    assert fake_cuda.registered == {} and not pool.pinned
    assert host_memory_stats()["pinned_bytes"] == before


@pytest.mark.parametrize("how", ["error", "raise"])
def test_a_failed_chunk_falls_back_to_pageable_with_one_warning(fake_cuda, monkeypatch, caplog, how):
    monkeypatch.setattr(cp, "REGISTER_CHUNK_BYTES", MiB)
    setattr(fake_cuda, "fail_at" if how == "error" else "raise_at", {2, 6})
    before = host_memory_stats()
    with caplog.at_level(logging.DEBUG, logger="kvtier.cpu"):
        a, b, c = (CpuPool(16, 256 * 1024, pin=True) for _ in range(3))   # 4 chunks each
    # a: registers 0, 1, fails at 2, unregisters 1 then 0; b: 3, 4, 5, fails at 6; c: pinned
    calls = [(k, ptr) for k, ptr, *_ in fake_cuda.calls]
    ra = [ptr for k, ptr in calls[:2]]
    rb = [ptr for k, ptr in calls[5:8]]
    assert calls[:5] == [("register", ra[0]), ("register", ra[1]), calls[2], ("unregister", ra[1]),
                         ("unregister", ra[0])]
    assert calls[8:12] == [calls[8], ("unregister", rb[2]), ("unregister", rb[1]), ("unregister", rb[0])]
    assert (a.pinned, b.pinned, c.pinned) == (False, False, True)
    assert sorted(fake_cuda.registered) == [ptr for k, ptr in calls[12:]]        # only c's chunks
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "cpu pool: cannot pin" in warnings[0] and "pageable" in warnings[0]
    assert ("out of memory" if how == "error" else "no cudart") in warnings[0]
    now = host_memory_stats()
    assert now["pin_fallbacks"] == before["pin_fallbacks"] + 2
    assert now["pinned_bytes"] == before["pinned_bytes"] + 16 * 256 * 1024
    n = len(fake_cuda.calls)
    a.close()
    b.close()                                           # nothing left to unregister for these
    assert len(fake_cuda.calls) == n
    c.close()
    assert fake_cuda.registered == {} and host_memory_stats()["pinned_bytes"] == before["pinned_bytes"]


def test_unregister_errors_are_counted_and_collection_unregisters(fake_cuda, caplog):
    gc.collect()
    before = host_memory_stats()
    hb = host_buffer(3 * PAGE, pin=True, what="probe")
    assert hb.pinned and len(fake_cuda.registered) == 1
    view = hb.tensor[:PAGE]                             # a view outliving the buffer stays valid
    del hb
    gc.collect()
    assert fake_cuda.registered == {}                   # the buffer was collected: unregistered
    view.fill_(3)
    assert int(view.sum()) == 3 * PAGE
    fake_cuda.fail_unregister = True
    hb = host_buffer(PAGE, pin=True, what="probe")
    with caplog.at_level(logging.WARNING, logger="kvtier.cpu"):
        hb.close()
        hb.close()                                      # twice: nothing more
    assert host_memory_stats()["unregister_errors"] == before["unregister_errors"] + 1
    assert "invalid argument" in caplog.text and host_memory_stats()["pinned_bytes"] == before["pinned_bytes"]


def test_without_cuda_memory_is_pageable(monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(cp, "CUDA", FakeCuda())
    monkeypatch.setattr(cp, "cuda_available", lambda: False)
    monkeypatch.setattr(cp.CUDA, "register", lambda *a: calls.append(a))
    with caplog.at_level(logging.WARNING, logger="kvtier.cpu"):
        assert not CpuPool(4, 8192, pin="auto").pinned and caplog.text == ""
        assert not CpuPool(4, 8192, pin=True).pinned
    assert "CUDA is not available" in caplog.text and calls == []
    assert not CpuPool(4, 8192, pin=False).pinned


def _resident_pages(addr: int, size: int) -> int:
    """How many pages of [addr, addr + size) are in RAM (bit 63 of /proc/self/pagemap entries)."""
    n = size // PAGE
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(addr // PAGE * 8)
        raw = f.read(8 * n)
    return sum(int.from_bytes(raw[i:i + 8], "little") >> 63 for i in range(0, 8 * n, 8))


def test_buffers_are_page_aligned_and_pre_touched():
    hb = HostBuffer(8 * MiB + 100)
    assert hb.tensor.data_ptr() % PAGE == 0 and hb.size == 8 * MiB + PAGE and not hb.pinned
    assert _resident_pages(hb.tensor.data_ptr(), hb.size) == hb.size // PAGE   # every page resident already
    assert int(hb.tensor.max()) == 0
    hb.close()
    assert HostBuffer(0).tensor.numel() == 0
    with pytest.raises(ValueError, match="size must be >= 0"):
        HostBuffer(-1)


def test_staging_rows_come_from_the_pinned_allocator(fake_cuda):
    bb = 3 * 4096 + 512                                 # rows not a page multiple: chunks on lcm
    s = Staging(bb)
    rows = s.views(5)
    assert s.pinned and len(rows) == 5 and all(r.numel() == bb for r in rows)
    assert rows[1].data_ptr() - rows[0].data_ptr() == bb
    first = dict(fake_cuda.registered)
    assert list(first) == [rows[0].data_ptr()]
    assert s.views(3)[0].data_ptr() == rows[0].data_ptr() and dict(fake_cuda.registered) == first  # no regrow
    bigger = s.views(9)                                 # grows: the old rows are unregistered
    assert len(bigger) == 9 and list(fake_cuda.registered) == [bigger[0].data_ptr()]
    assert s.rows().shape == (9, bb)
    s.close()
    assert fake_cuda.registered == {} and not s.pinned
    assert not Staging(bb, pin=False).pinned


def test_cuda_registry_checks_errors_and_clears_them(monkeypatch):
    """The real `CudaHostRegistry` over a fake `torch.cuda.cudart()`: the portable flag, the error
    text, and the pending error taken off the thread after a failure."""

    class Err(int):
        pass

    class Rt:
        def __init__(self):
            self.calls = []

        def cudaHostRegister(self, ptr, size, flags):
            self.calls.append(("register", ptr, size, flags))
            return Err(0 if size < 100 else 2)

        def cudaHostUnregister(self, ptr):
            self.calls.append(("unregister", ptr))
            return Err(1)

        def cudaGetErrorString(self, err):
            return {1: "invalid argument", 2: "out of memory"}[int(err)]

    rt = Rt()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    reg = CudaHostRegistry()
    cleared = []
    reg._get_last_error = lambda: cleared.append(1)
    assert reg.register(4096, 10) is None and cleared == []
    assert reg.register(4096, 1000) == "cudaHostRegister: CUDA error 2 (out of memory)" and cleared == [1]
    assert reg.unregister(4096) == "cudaHostUnregister: CUDA error 1 (invalid argument)" and cleared == [1, 1]
    assert rt.calls[0] == ("register", 4096, 10, 1)    # cudaHostRegisterPortable
    assert cp._loaded_library("libc.so") or cp._loaded_library("libc-")   # the maps lookup finds a loaded lib


# ---- on a GPU machine ------------------------------------------------------------------------
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
def test_pinned_pool_on_cuda(monkeypatch):  # pragma: no cover - GPU only
    """The real registration: every chunk is page-locked (torch sees it pinned), a non-blocking
    copy round-trips byte-exact, and close() leaves the memory pageable."""
    monkeypatch.setattr(cp, "REGISTER_CHUNK_BYTES", 4 * MiB)
    bb = 256 * 1024
    pool = CpuPool(64, bb, pin=True)                   # 16 MiB in 4 registrations
    assert pool.pinned and len(pool.host.chunks) == 4
    assert all(v.is_pinned() for v in pool.views)
    src = torch.randint(0, 256, (64 * bb,), dtype=torch.uint8, device="cuda")
    pool.buffer.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    back = torch.empty_like(src)
    back.copy_(pool.buffer, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, src)
    view = pool.views[3]
    pool.close()
    assert not view.is_pinned()


@pytest.mark.gpu
@gpu
def test_failed_registration_does_not_poison_later_cuda_calls():  # pragma: no cover - GPU only
    """Registering a range twice fails (already registered); the error must not surface in the
    next kernel launch check."""
    hb = HostBuffer(MiB, pin=True)
    assert hb.pinned
    why = cp.CUDA.register(hb.tensor.data_ptr(), MiB)
    assert why is not None and "CUDA error" in why
    x = torch.ones(1024, device="cuda") * 2                # a kernel launch, checked by PyTorch
    torch.cuda.synchronize()
    assert float(x.sum()) == 2048.0
    hb.close()
