"""NvmeTier: byte-exact round trips, restart recovery, capacity, corruption, fingerprints, errors."""

from __future__ import annotations

import errno
import logging
import os

import pytest
import torch

from kvtier.offline.blockgen import block_data, block_key
from kvtier.policies.lru import LRU
from kvtier.tiers.base import TierFull
from kvtier.tiers.nvme import NvmeTier
from kvtier.tiers.nvme_dir import DATA_FILE, FingerprintMismatch


def mk(path, cap=32, bb=8192, **kw):
    return NvmeTier("nvme", str(path), cap, bb, LRU(cap), io="posix", **kw)


def put(tier, seed, idx):
    keys = [block_key(seed, i) for i in idx]
    data = [block_data(seed, i, tier.block_bytes) for i in idx]
    slots = tier.allocate(keys)
    res = tier.write(slots, data).wait()
    assert res.all_ok, res.errors
    tier.commit(slots)
    return keys, slots, data


def get(tier, slots):
    out = [torch.full((tier.block_bytes,), 0x5A, dtype=torch.uint8) for _ in slots]
    return tier.read(slots, out).wait(), out


@pytest.mark.parametrize("bb", [4096, 5000, 12288, 65536 + 17, 256 << 10])
def test_round_trip_byte_exact(tmp_path, bb):
    with mk(tmp_path, cap=24, bb=bb) as t:
        keys, slots, data = put(t, 3, range(20))
        assert t.lookup(keys) == 20
        res, out = get(t, slots)
        assert res.ok == [True] * 20
        for a, b in zip(out, data):
            assert torch.equal(a, b)
        st = t.stats()
        assert st["bytes_written"] == st["bytes_read"] == 20 * bb
        assert st["slot_stride"] % 4096 == 0 and st["slot_stride"] >= bb
        assert os.path.getsize(tmp_path / DATA_FILE) == 24 * st["slot_stride"]


def test_unaligned_and_aligned_sources(tmp_path):
    bb = 16384
    with mk(tmp_path, cap=8, bb=bb) as t:
        backing = torch.empty(4 * bb + 1, dtype=torch.uint8)
        srcs = []
        for i in range(4):  # views at odd addresses force the bounce path
            v = backing[1 + i * bb: 1 + (i + 1) * bb]
            v.copy_(block_data(9, i, bb))
            srcs.append(v)
        keys = [block_key(9, i) for i in range(4)]
        slots = t.allocate(keys)
        assert t.write(slots, srcs).wait().all_ok
        t.commit(slots)
        assert t.stats()["io"]["bounced_blocks"] == 4
        res, out = get(t, slots)
        assert res.all_ok and all(torch.equal(o, block_data(9, i, bb)) for i, o in enumerate(out))


def test_restart_recovery(tmp_path):
    t = mk(tmp_path, cap=40)
    keys, slots, data = put(t, 1, range(30))
    t.evict(slots[:5])                       # evicted before close: must stay gone
    pend = t.allocate([block_key(2, 0)])     # written but never committed: free after restart
    assert t.write(pend, [block_data(2, 0, t.block_bytes)]).wait().all_ok
    t.close()
    t = mk(tmp_path, cap=40)
    try:
        assert t.num_resident == 25 and t.num_used == 25
        assert t.restored_blocks == 25
        assert t.lookup(keys[:5]) == 0 and t.lookup(keys[5:]) == 25
        assert t.lookup([block_key(2, 0)]) == 0
        got_slots = [t.find(k) for k in keys[5:]]
        assert got_slots == slots[5:]
        res, out = get(t, got_slots)
        assert res.ok == [True] * 25
        assert all(torch.equal(a, b) for a, b in zip(out, data[5:]))
        # restored in generation order: the oldest surviving block is the first victim
        assert next(t.iter_free_blocks()).block_id == slots[5]
    finally:
        t.close()


def test_capacity_and_eviction_delete_index_entries(tmp_path):
    with mk(tmp_path, cap=8) as t:
        keys, slots, _ = put(t, 4, range(8))
        with pytest.raises(TierFull):
            t.allocate([block_key(4, 100)])
        assert len(t.index) == 8
        victims = [b.block_id for b in t.iter_free_blocks()][:3]
        assert victims == slots[:4:-1]        # lru: one call's blocks leave tail first (as vLLM frees them)
        assert t.evict(victims) == keys[:4:-1]
        assert t.num_free_slots == 3 and len(t.index) == 5
        assert all(t.index.get(k) is None for k in keys[5:])
        put(t, 5, range(3))
        assert t.num_free_slots == 0 and len(t.index) == 8


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def test_corrupt_blocks_are_counted_dropped_and_missed(tmp_path, caplog):
    t = mk(tmp_path, cap=16, bb=5000)
    keys, slots, data = put(t, 6, range(10))
    t.close()
    bad = [1, 4, 7]
    for i in bad:
        _flip(tmp_path / DATA_FILE, slots[i] * 12288 + 4096 + 1234)  # slot: header page + 8 KiB
    _flip(tmp_path / DATA_FILE, slots[2] * 12288 + 4096 + 6000)  # padding byte: not part of the block
    t = mk(tmp_path, cap=16, bb=5000)
    try:
        with caplog.at_level(logging.ERROR, logger="kvtier.nvme"):
            res, out = get(t, slots)
        assert res.ok == [i not in bad for i in range(10)]
        assert t.corrupt_blocks == 3 and t.stats()["corrupt_blocks"] == 3
        assert "corrupt" in caplog.text
        for i in range(10):
            if i not in bad:
                assert torch.equal(out[i], data[i])
        assert [t.lookup([k]) for k in keys] == [0 if i in bad else 1 for i in range(10)]
        assert len(t.index) == 7 and t.num_resident == 7 and t.num_free_slots == 9
        # a second read of the good blocks counts nothing more
        res, _ = get(t, [slots[i] for i in range(10) if i not in bad])
        assert res.all_ok and t.corrupt_blocks == 3
    finally:
        t.close()
    with mk(tmp_path, cap=16, bb=5000) as t:  # the drops are durable
        assert t.num_resident == 7 and t.lookup([keys[1]]) == 0


def test_corrupt_pinned_block_freed_on_last_unpin(tmp_path):
    with mk(tmp_path, cap=4) as t:
        keys, slots, _ = put(t, 8, range(2))
        t.close()
    _flip(tmp_path / DATA_FILE, slots[0] * 12288 + 4096)
    with mk(tmp_path, cap=4) as t:
        t.touch([slots[0]])
        res, _ = get(t, [slots[0]])
        assert res.ok == [False] and t.lookup([keys[0]]) == 0
        assert t.num_free_slots == 2          # still pinned: not reusable yet
        with pytest.raises(ValueError, match="holds no block"):
            get(t, [slots[0]])
        t.free_blocks([slots[0]])
        assert t.num_free_slots == 3


def test_fingerprint_refuse_names_fields(tmp_path):
    with mk(tmp_path, fingerprint={"model": "a", "dtype": "bf16", "rank": 0}) as t:
        put(t, 1, range(3))
    with pytest.raises(FingerprintMismatch) as ei:
        mk(tmp_path, fingerprint={"model": "b", "dtype": "bf16", "rank": 1})
    assert set(ei.value.diffs) == {"model", "rank"}
    assert "model: stored='a' ours='b'" in str(ei.value)
    with pytest.raises(FingerprintMismatch, match="block_bytes"):
        mk(tmp_path, bb=4096, fingerprint={"model": "a", "dtype": "bf16", "rank": 0})
    with mk(tmp_path, fingerprint={"model": "a", "dtype": "bf16", "rank": 0}) as t:  # the lock was released
        assert t.num_resident == 3


def test_fingerprint_namespace_never_serves_foreign(tmp_path):
    fa, fb = {"model": "a"}, {"model": "b"}
    with mk(tmp_path, fingerprint=fa) as t:
        keys, _, data_a = put(t, 1, range(4))
    with mk(tmp_path, fingerprint=fb, on_mismatch="namespace") as t:
        assert t.namespace and t.namespace.startswith("ns-")
        assert t.stats()["path"] == str(tmp_path / t.namespace)
        assert t.lookup(keys) == 0 and t.num_resident == 0
        _, slots_b, data_b = put(t, 1, range(2))
        t.close()
    with mk(tmp_path, fingerprint=fb, on_mismatch="namespace") as t:
        assert t.num_resident == 2
        res, out = get(t, [t.find(k) for k in keys[:2]])
        assert res.all_ok and all(torch.equal(a, b) for a, b in zip(out, data_b))
    with mk(tmp_path, fingerprint=fa) as t:
        assert t.num_resident == 4


def test_odirect_refused_falls_back_to_buffered(tmp_path, monkeypatch, caplog):
    import kvtier.tiers.io_engine as ioe

    real = ioe._os_open

    def no_direct(path, flags, mode=0o777, **kw):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags, mode, **kw)

    monkeypatch.setattr(ioe, "_os_open", no_direct)
    with caplog.at_level(logging.WARNING, logger="kvtier.nvme"):
        t = mk(tmp_path, cap=8, bb=5000)
    try:
        st = t.stats()
        assert st["io"]["io_mode"] == "buffered"
        assert "O_DIRECT refused: EINVAL" in st["engine"] and str(tmp_path) in st["engine"]
        assert "O_DIRECT refused" in caplog.text
        keys, slots, data = put(t, 2, range(6))
        res, out = get(t, slots)
        assert res.all_ok and all(torch.equal(a, b) for a, b in zip(out, data))
        assert st["io"]["bounced_blocks"] == 0  # buffered: no bounce needed
    finally:
        t.close()


def test_direct_required_but_refused_is_an_error(tmp_path, monkeypatch):
    import kvtier.tiers.io_engine as ioe

    real = ioe._os_open
    monkeypatch.setattr(ioe, "_os_open", lambda p, f, m=0o777, **kw: (_ for _ in ()).throw(
        OSError(errno.EINVAL, "Invalid argument")) if f & os.O_DIRECT else real(p, f, m, **kw))
    with pytest.raises(OSError, match="O_DIRECT") as ei:
        mk(tmp_path, direct=True)
    assert ei.value.errno == errno.EINVAL


def test_dev_shm_reports_engine(tmp_path_factory):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    import tempfile
    d = tempfile.mkdtemp(dir="/dev/shm")
    try:
        with mk(d, cap=4) as t:
            st = t.stats()
            # tmpfs may accept O_DIRECT (Linux >= 6.6) or refuse it: either way it is reported
            assert st["io"]["io_mode"] in ("O_DIRECT", "buffered")
            assert (st["io"]["fallback"] is None) == (st["io"]["io_mode"] == "O_DIRECT")
            keys, slots, data = put(t, 1, range(4))
            res, out = get(t, slots)
            assert res.all_ok and all(torch.equal(a, b) for a, b in zip(out, data))
    finally:
        import shutil
        shutil.rmtree(d)


def test_bad_path_clear_error(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(OSError) as ei:
        mk(f / "sub")
    assert ei.value.errno == errno.ENOTDIR and str(f / "sub") in str(ei.value)
    ro = "/proc/kvtier-nvme-test"
    with pytest.raises(OSError) as ei:
        mk(ro)
    assert ro in str(ei.value) and ei.value.errno is not None


def test_capacity_larger_than_free_disk(tmp_path):
    with pytest.raises(OSError) as ei:
        NvmeTier("nvme", str(tmp_path), 1 << 40, 1 << 20, LRU(8), io="posix")
    assert ei.value.errno == errno.ENOSPC
    msg = str(ei.value)
    assert str((1 << 40) * ((1 << 20) + 4096)) in msg and "free" in msg
    assert not (tmp_path / DATA_FILE).exists() or os.path.getsize(tmp_path / DATA_FILE) == 0


def test_second_open_of_same_dir_refused(tmp_path):
    with mk(tmp_path):
        with pytest.raises(OSError, match="already open"):
            mk(tmp_path)


def test_commit_requires_written_data(tmp_path):
    with mk(tmp_path) as t:
        slots = t.allocate([block_key(1, 0)])
        with pytest.raises(ValueError, match="never written"):
            t.commit(slots)
        assert t.lookup([block_key(1, 0)]) == 0 and len(t.index) == 0
        t.abort(slots)
        assert t.num_free_slots == t.capacity_blocks


def test_commit_without_wait_and_twins(tmp_path):
    with mk(tmp_path) as t:
        k = block_key(1, 0)
        d = block_data(1, 0, t.block_bytes)
        a = t.allocate([k])
        t.write(a, [d])          # not waited: commit waits for it
        b = t.allocate([k])      # a twin allocated while the first is pending
        assert t.write(b, [block_data(1, 1, t.block_bytes)]).wait().all_ok
        t.commit(a)
        t.commit(b)              # twin: the resident one is kept, index still points at it
        assert t.find(k) == a[0] and t.index.get(k).slot == a[0]
        assert t.num_used == 1
        t.close()
    with mk(tmp_path) as t:
        res, out = get(t, [t.find(k)])
        assert res.all_ok and torch.equal(out[0], d)


def test_wrong_buffer_size_and_bad_state(tmp_path):
    with mk(tmp_path, bb=8192) as t:
        s = t.allocate([block_key(1, 0)])
        with pytest.raises(ValueError, match="holds 4096 bytes, block_bytes is 8192"):
            t.write(s, [torch.zeros(4096, dtype=torch.uint8)])
        with pytest.raises(ValueError, match="not pending"):
            t.write([5], [torch.zeros(8192, dtype=torch.uint8)])
        with pytest.raises(ValueError, match="holds no block"):
            get(t, [5])


def test_metadata_only(tmp_path):
    t = NvmeTier("nvme", str(tmp_path / "none"), 4, 1 << 20, LRU(4), with_data=False)
    assert not (tmp_path / "none").exists()
    s = t.allocate([block_key(1, 0)])
    t.commit(s)
    assert t.lookup([block_key(1, 0)]) == 1
    assert t.stats()["engine"] == "none (metadata only)"
    with pytest.raises(RuntimeError, match="metadata-only"):
        t.read(s, [torch.zeros(1 << 20, dtype=torch.uint8)])
    t.close()


def test_capacity_shrink_is_refused_unless_asked(tmp_path):
    from kvtier.tiers.nvme_recovery import CapacityShrink
    with mk(tmp_path, cap=16) as t:
        keys, slots, data = put(t, 1, range(16))
    size = os.path.getsize(tmp_path / DATA_FILE)
    with pytest.raises(CapacityShrink, match="stores 16 blocks, 8 of them in slots beyond .* capacity of 8"):
        mk(tmp_path, cap=8)
    with mk(tmp_path, cap=8, read_only=True) as t:  # read-only: served within, nothing changed
        assert t.num_resident == 8 and t.beyond_capacity == 8 and t.dropped_on_open == 0
    with mk(tmp_path, cap=16) as t:
        assert t.num_resident == 16
    with mk(tmp_path, cap=8, allow_shrink=True) as t:
        assert t.num_resident == 8 and t.dropped_on_open == 8
        assert sorted(t.find(k) for k in keys if t.find(k) is not None) == list(range(8))
    assert os.path.getsize(tmp_path / DATA_FILE) == size  # the file is never truncated


def test_capacity_larger_than_free_disk_realistic(tmp_path):
    import shutil
    free = shutil.disk_usage(tmp_path).free
    cap = free // (1 << 20) + 1024
    with pytest.raises(OSError) as ei:
        NvmeTier("nvme", str(tmp_path / "t"), cap, 1 << 20, LRU(8), io="posix")
    assert ei.value.errno == errno.ENOSPC and str(cap * ((1 << 20) + 4096)) in str(ei.value)
    assert not (tmp_path / "t" / DATA_FILE).exists()


def test_swapped_entries_are_quarantined_misses(tmp_path):
    """Two index entries swapped (slot and tag): each read fails the header's key check, both
    entries move to the quarantine, lookups miss, and it is durable."""
    import lmdb
    with mk(tmp_path, cap=8) as t:
        keys, slots, data = put(t, 3, range(4))
    env = lmdb.open(str(tmp_path / "index"), max_dbs=4)
    db = env.open_db(b"entries")
    with env.begin(write=True) as txn:
        a, b = txn.get(keys[0], db=db), txn.get(keys[1], db=db)
        txn.put(keys[0], b, db=db)
        txn.put(keys[1], a, db=db)
    env.close()
    with mk(tmp_path, cap=8) as t:
        res, out = get(t, [t.find(k) for k in keys])
        assert res.ok == [False, False, True, True] and t.corrupt_blocks == 2
        assert "misdirected" in res.errors[0]
        assert t.lookup([keys[0]]) == 0 and t.lookup([keys[1]]) == 0 and t.stats()["quarantined"] == 2
    with mk(tmp_path, cap=8) as t:
        assert t.num_resident == 2 and t.stats()["quarantined"] == 2


def test_second_writer_in_this_process_is_refused(tmp_path):
    from kvtier.tiers.nvme_dir import DirectoryInUse
    with mk(tmp_path, cap=4):
        with pytest.raises(DirectoryInUse, match=f"already open in this process \\(pid {os.getpid()}\\)"):
            mk(tmp_path, cap=4)


def test_secret_and_files_are_private(tmp_path):
    import stat
    with mk(tmp_path / "d", cap=4) as t:
        put(t, 1, range(2))
    assert stat.S_IMODE(os.stat(tmp_path / "d").st_mode) == 0o700
    for f in ("secret", DATA_FILE, "index/data.mdb"):
        assert stat.S_IMODE(os.stat(tmp_path / "d" / f).st_mode) == 0o600, f


def test_the_directory_records_its_fingerprint(tmp_path):
    """fingerprint.json (0600) holds what the directory was opened under; a torn one (a crash
    while writing it) is rewritten at the next open; read-only opens write nothing."""
    import json
    import stat as _stat
    fp = {"model": "a", "dtype": "bf16", "rank": 0}
    with mk(tmp_path, fingerprint=fp) as t:
        want = t.fingerprint
    rec = tmp_path / "fingerprint.json"
    assert json.loads(rec.read_text()) == want and want["model"] == "a"
    assert _stat.S_IMODE(rec.stat().st_mode) == 0o600
    rec.write_text('{"model": ')
    with mk(tmp_path, fingerprint=fp, read_only=True):
        pass
    assert rec.read_text() == '{"model": '
    with mk(tmp_path, fingerprint=fp):
        pass
    assert json.loads(rec.read_text()) == want


# ---- a real small file system: full, read-only (tests/fs_util.py) --------------------------------
def _fill(path: str) -> int:
    """Write a filler file under `path` until the file system is full; bytes written."""
    n = 0
    chunk = b"\xa5" * (1 << 20)
    with open(os.path.join(path, "filler"), "wb", buffering=0) as f:
        while True:
            try:
                n += f.write(chunk)
            except OSError as e:
                assert e.errno == errno.ENOSPC
                break
        while True:  # the last partial block
            try:
                n += f.write(b"\xa5" * 4096)
            except OSError:
                break
    os.sync()
    return n


def test_full_disk_at_the_index_commit_is_enospc_naming_the_path(tmp_path):
    """The data file is preallocated, so a full disk shows first at the LMDB commit, which LMDB
    reports as EIO (a short write): it is ENOSPC with the index path, and nothing is indexed."""
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    from fs_util import small_fs
    with small_fs("16M") as fs:
        d = os.path.join(fs.path, "nv")
        with mk(d, cap=64, bb=65536) as t:
            put(t, 1, range(4))
            _fill(fs.path)
            with pytest.raises(OSError) as e:
                for lo in range(4, 64, 8):    # the index grows page by page until a commit finds no room
                    put(t, 1, range(lo, lo + 8))
                    put(t, 2, range(lo, lo + 8))
            assert e.value.errno == errno.ENOSPC and f"index {d}/index: write failed: [ENOSPC]" in str(e.value)
            held = {k for k in t.resident}
        os.unlink(os.path.join(fs.path, "filler"))
        with mk(d, cap=64, bb=65536) as t:    # what was committed is whole and served
            assert set(t.resident) == held and block_key(1, 0) in held
            res, _ = get(t, [t.resident[block_key(1, j)] for j in range(4)])
            assert res.all_ok


def test_read_only_file_system_is_erofs(tmp_path):
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    from fs_util import small_fs
    with small_fs("16M") as fs:
        d = os.path.join(fs.path, "nv")
        with mk(d, cap=8, bb=65536) as t:
            put(t, 1, range(3))
        fs.remount(read_only=True)
        try:
            for path in (d, os.path.join(fs.path, "new", "nv")):
                with pytest.raises(OSError) as e:
                    mk(path, cap=8, bb=65536)
                assert e.value.errno == errno.EROFS and "EROFS" in str(e.value), e.value
            with mk(d, cap=8, bb=65536, read_only=True) as t:    # reading still works
                assert len(t.resident) == 3
        finally:
            fs.remount(read_only=False)


def test_parent_directories_kvtier_creates_are_private(tmp_path):
    import stat
    d = tmp_path / "a" / "b" / "nv"
    old = os.umask(0o022)
    try:
        mk(d, cap=4).close()
    finally:
        os.umask(old)
    assert [oct(stat.S_IMODE(p.stat().st_mode)) for p in (tmp_path / "a", tmp_path / "a" / "b", d)] == ["0o700"] * 3
