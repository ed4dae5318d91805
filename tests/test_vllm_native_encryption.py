"""Encryption at rest for kvtier's tiers under vLLM's native offloading (`kvtier.vllm`): the
`encryption` key of a secondary tier's dict, through vLLM's real `TieringOffloadingManager`
(tests/native_util.py), real files and a real redis-server (issue 26)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from native_util import Deployment, model_dir, nvme, offload_key, payload, shared  # noqa: E402


def _key(tmp_path: Path, name: str) -> dict:
    p = tmp_path / name
    p.write_bytes(os.urandom(32))
    os.chmod(p, 0o600)
    return {"key_file": str(p)}


def test_native_tiers_encrypt_and_a_wrong_key_is_a_miss(tmp_path, redis_server):
    k1, k2 = _key(tmp_path, "k1"), _key(tmp_path, "k2")
    model = model_dir(tmp_path, 21)
    dep = Deployment(model, [nvme(tmp_path / "nv", encryption=k1),
                             shared(redis_server.url, namespace="enc", encryption=k1)])
    keys = [offload_key(i, b"enc") for i in range(8)]
    datas = [payload(i, dep.chunk_bytes, b"enc") for i in range(8)]
    dep.store(keys[:4], datas[:4])
    dep.store(keys[4:], datas[4:])                          # the primary evicted the first four
    nv, sh = dep.tiers
    assert nv.tier.data.codec.sealer is not None and sh.tier.ns.codec.sealer is not None
    assert dep.load(keys[:4]) == datas[:4]                  # from below the primary, decrypted, byte-exact
    dep.close()
    disk = b"".join(p.read_bytes() for p in (tmp_path / "nv").rglob("*") if p.is_file())
    assert not any(d[o:o + 32] in disk for d in datas for o in (0, len(d) // 2))
    # another instance of the same model with another key: nothing it can open is served
    other = Deployment(model, [shared(redis_server.url, namespace="enc", encryption=k2)])
    try:
        assert other.load(keys[:4]) == []
        assert other.tiers[0].tier.stats()["decrypt_failed_blocks"] >= 1
    finally:
        other.close()
    again = Deployment(model, [nvme(tmp_path / "nv", encryption=k2)])
    try:
        assert again.load(keys[:4]) == []
        assert again.tiers[0].counters["corrupt_chunks"] == 4   # not served, quarantined: later lookups miss
        assert again.load(keys[:4]) == []
    finally:
        again.close()
