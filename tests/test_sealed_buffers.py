"""The encrypted tiers' host buffers are made once, not per transfer: a sealed NVMe tier's
bounce buffers at open (its spills and restores make none), an encrypted shared put's
ciphertexts in one buffer per pool thread reused across batches, every value byte-exact."""

from __future__ import annotations

import torch

from kvtier.offline.blockgen import block_data, block_key
from kvtier.policies.lru import LRU
from kvtier.tiers.nvme import NvmeTier
from kvtier.tiers.shared_conn import Namespace, RedisSettings
from kvtier.tiers.shared_data import SharedData
from kvtier.tiers.sealing import Sealer

BB = 65536 + 17   # not a multiple of 4 KiB: the padding after each ciphertext is written too
KEY = bytes(range(32))


def _tier(path, sealer, threads: int = 2, cap: int = 48) -> NvmeTier:
    return NvmeTier("nvme", str(path), cap, BB, LRU(cap), io="posix", io_threads=threads, sealer=sealer)


def test_encrypted_nvme_tier_makes_its_buffers_at_open(tmp_path):
    with _tier(tmp_path / "enc", Sealer(KEY), threads=2) as t:
        assert t.stats()["io"]["buffers_made"] == 2      # one per I/O thread, at open
        keys = [block_key(3, i) for i in range(40)]     # several runs a thread
        data = [block_data(3, i, BB) for i in range(40)]
        slots = t.allocate(keys)
        assert t.write(slots, data).wait().all_ok
        t.commit(slots)
        out = [torch.full((BB,), 0x5A, dtype=torch.uint8) for _ in keys]
        assert t.read(slots, out).wait().all_ok
        assert all(torch.equal(a, b) for a, b in zip(out, data))
        assert t.stats()["io"]["buffers_made"] == 2      # none made by the spill or the restore
    with _tier(tmp_path / "plain", None) as t:          # a plain tier moves page-aligned blocks as they are
        assert t.stats()["io"]["buffers_made"] == 0


def test_encrypted_shared_puts_reuse_a_buffer_and_stay_byte_exact(redis_server):
    s = RedisSettings(url=redis_server.url, timeout_s=2.0, secret="fleet", batch_bytes=2 * BB)  # 2 values a batch
    rd = SharedData(s, Namespace({"model": "reuse", "block_bytes": BB}, "fleet", 0, Sealer(KEY)), BB, threads=1)
    try:
        keys = [f"reuse-{i}".encode() for i in range(7)]
        for seed in (1, 2):  # the second write's ciphertexts go through the buffer the first one used
            data = [block_data(seed, i, BB) for i in range(7)]
            assert rd.write((), data, keys).wait().all_ok
            cl = redis_server.client()
            values = [cl.get(rd.ns.name(k)) for k in keys]
            assert len(set(values)) == 7 and all(len(v) == rd.ns.codec.header_size(k) + BB
                                                 for k, v in zip(keys, values))
            out = [torch.zeros(BB, dtype=torch.uint8) for _ in keys]
            r = rd.read((), out, keys).wait()
            assert r.all_ok and all(torch.equal(a, b) for a, b in zip(out, data))
        assert "decrypt_failed_blocks" not in rd.counters
    finally:
        rd.close()
