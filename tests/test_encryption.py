"""Encryption at rest (issue 26): the NVMe and shared tiers seal every block with AES-256-GCM.
Real files, the real CLI, a real redis-server: no plaintext at rest, a wrong key is misses and
a counter, rotation reads old blocks only with the old key, a moved or planted block never opens."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch

from kvtier.cli.main import main
from kvtier.core.config import ConfigError, parse_config
from kvtier.offline.blockgen import block_data, block_key
from kvtier.policies.lru import LRU
from kvtier.tiers.nvme import NvmeTier
from kvtier.tiers.nvme_block import BlockCodec
from kvtier.tiers.shared_conn import Namespace, RedisSettings
from kvtier.tiers.shared_data import SharedData
from kvtier.tiers.sealing import BadKey, Sealer, read_key_file

BB = 65536
K1, K2 = bytes(range(32)), bytes(range(100, 132))


def key_file(tmp_path: Path, name: str, key: bytes, mode: int = 0o600, hex_: bool = False) -> str:
    p = tmp_path / name
    p.write_bytes(key.hex().encode() + b"\n" if hex_ else key)
    os.chmod(p, mode)
    return str(p)


def write_cfg(tmp_path: Path, enc: str | None, name: str = "stack.yaml", nvme: str = "nvme") -> str:
    p = tmp_path / name
    p.write_text(f"""
block_bytes: {BB}
tiers:
  - {{name: cpu, kind: cpu, capacity_blocks: 8}}
  - {{name: nvme, kind: nvme, path: {tmp_path}/{nvme}, capacity_blocks: 128, io: posix{', encryption: ' + enc if enc else ''}}}
""")
    return str(p)


def run_json(capsys, *argv):
    rc = main([*argv, "--json"])
    out = capsys.readouterr().out.strip().splitlines()[-1]
    return rc, json.loads(out)


def all_bytes(d: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file())


def plaintext_windows(seed: int, n: int) -> list[bytes]:
    """Four 32-byte windows of each spilled block: any of them on disk is plaintext at rest."""
    out = []
    for i in range(n):
        b = block_data(seed, i, BB).numpy().tobytes()
        out += [b[o:o + 32] for o in (0, 4096, BB // 2 + 7, BB - 32)]
    return out


# ---- the CLI on real files ------------------------------------------------------------------
def test_spilled_directory_holds_no_plaintext_and_restores_verified(tmp_path, capsys):
    enc = f"{{key_file: {key_file(tmp_path, 'k1', K1)}}}"
    cfg = write_cfg(tmp_path, enc)
    rc, s = run_json(capsys, "spill", "--config", cfg, "--blocks", "40", "--seed", "5")
    assert rc == 0 and s["nvme_resident"] == 40
    disk = all_bytes(tmp_path / "nvme")   # data file, index, manifest, secret: every file
    assert len(disk) > 40 * BB
    assert not any(w in disk for w in plaintext_windows(5, 40))
    rc, r = run_json(capsys, "restore", "--config", cfg, "--verify")
    assert rc == 0
    assert (r["restored"], r["corrupt"], r["missing"], r["bad_served"], r["verified"]) == (40, 0, 0, 0, True)
    # the search finds the pattern when the tier is not encrypted (the check can fail)
    plain = write_cfg(tmp_path, None, "plain.yaml", nvme="plain")
    assert run_json(capsys, "spill", "--config", plain, "--blocks", "40", "--seed", "5")[0] == 0
    disk = all_bytes(tmp_path / "plain")
    assert all(w in disk for w in plaintext_windows(5, 40))


def test_wrong_key_is_misses_a_counter_and_one_line(tmp_path, capsys, caplog):
    cfg = write_cfg(tmp_path, f"{{key_file: {key_file(tmp_path, 'k1', K1)}}}")
    assert run_json(capsys, "spill", "--config", cfg, "--blocks", "40", "--seed", "2")[0] == 0
    os.environ["KVTIER_TEST_WRONG_KEY"] = K2.hex()
    try:
        wrong = write_cfg(tmp_path, "{key_env: KVTIER_TEST_WRONG_KEY}", "wrong.yaml")
        with caplog.at_level(logging.ERROR, logger="kvtier.nvme"):
            rc, r = run_json(capsys, "restore", "--config", wrong, "--verify")
    finally:
        del os.environ["KVTIER_TEST_WRONG_KEY"]
    r = r["result"]
    assert rc == 1 and (r["restored"], r["corrupt"], r["decrypt_failed"], r["bad_served"]) == (0, 40, 40, 0)
    lines = [m for m in caplog.messages if "failed verification" in m]
    assert len(lines) == 1 and "not a key this tier reads" in lines[0]
    rc, r = run_json(capsys, "restore", "--config", cfg, "--verify")  # read-only: nothing was lost
    assert rc == 0 and r["verified_blocks"] == 40


def test_plaintext_directory_opened_encrypted_is_misses_not_plaintext(tmp_path, capsys):
    plain = write_cfg(tmp_path, None)
    assert run_json(capsys, "spill", "--config", plain, "--blocks", "20", "--seed", "1")[0] == 0
    enc = write_cfg(tmp_path, f"{{key_file: {key_file(tmp_path, 'k1', K1)}}}", "enc.yaml")
    rc, r = run_json(capsys, "restore", "--config", enc, "--verify")
    r = r["result"]
    assert rc == 1 and (r["restored"], r["decrypt_failed"], r["bad_served"]) == (0, 20, 0)
    # ... and an encrypted directory read without the key never hands ciphertext as KV
    assert run_json(capsys, "spill", "--config", enc, "--blocks", "20", "--seed", "3")[0] == 0
    rc, r = run_json(capsys, "restore", "--config", plain, "--verify", "--seed", "3")
    r = r["result"]
    assert rc == 1 and (r["restored"], r["decrypt_failed"], r["bad_served"]) == (0, 20, 0)


# ---- the NVMe tier --------------------------------------------------------------------------
def mk(path, sealer, cap=24, bb=BB):
    return NvmeTier("nvme", str(path), cap, bb, LRU(cap), io="posix", sealer=sealer)


def put(t, seed, n, srcs=None):
    keys = [block_key(seed, i) for i in range(n)]
    data = srcs or [block_data(seed, i, t.block_bytes) for i in range(n)]
    slots = t.allocate(keys)
    assert t.write(slots, data).wait().all_ok
    t.commit(slots)
    return keys, [d.clone() for d in data]


def get(t, keys):
    slots = [t.find(k) for k in keys]
    out = [torch.full((t.block_bytes,), 0x5A, dtype=torch.uint8) for _ in keys]
    return t.read(slots, out).wait(), out


@pytest.mark.parametrize("bb", [4096, 5000, 65536 + 17])
def test_round_trip_byte_exact_after_restart(tmp_path, bb):
    with mk(tmp_path, Sealer(K1), bb=bb) as t:
        backing = torch.empty(3 * bb + 1, dtype=torch.uint8)  # odd addresses: the copy-in path
        srcs = [backing[1 + i * bb:1 + (i + 1) * bb] for i in range(3)]
        for i, v in enumerate(srcs):
            v.copy_(block_data(4, i, bb))
        keys, data = put(t, 4, 3, srcs)
        st = t.stats()
        assert st["slot_stride"] == 4096 + (bb + 4095) // 4096 * 4096  # the seal fits the header page
    with mk(tmp_path, Sealer(K1), bb=bb) as t:
        res, out = get(t, keys)
        assert res.all_ok and all(torch.equal(a, b) for a, b in zip(out, data))
        assert t.stats()["decrypt_failed_blocks"] == 0


def test_rotation_reads_old_blocks_only_with_the_old_key(tmp_path):
    with mk(tmp_path / "a", Sealer(K1)) as t:
        keys, data = put(t, 1, 6)
    with mk(tmp_path / "a", Sealer(K2, [K1])) as t:   # new key, the old one kept for reading
        res, out = get(t, keys)
        assert res.all_ok and all(torch.equal(a, b) for a, b in zip(out, data))
        new_keys, new_data = put(t, 2, 3)
    with mk(tmp_path / "a", Sealer(K2)) as t:         # the old key dropped: its blocks are misses
        res, _ = get(t, keys)
        assert res.ok == [False] * 6 and t.stats()["decrypt_failed_blocks"] == 6
        assert t.lookup(keys) == 0
        res, out = get(t, new_keys)
        assert res.all_ok and all(torch.equal(a, b) for a, b in zip(out, new_data))


class _AsIs:
    """A stand-in sealer for forging a header: 'encrypts' by copying, and reuses a real record."""

    def __init__(self, record: bytes) -> None:
        self.record = record

    def seal_into(self, data, buf, aad):
        buf[:len(data)] = data
        return self.record


def _sealed(codec: BlockCodec, key: bytes, payload: bytes) -> tuple[bytearray, bytearray, int]:
    hdr, out = bytearray(4096), bytearray(len(payload) + 16)
    tag = codec.seal(memoryview(hdr), key, memoryview(payload), memoryview(out))
    return hdr, out, tag


@pytest.mark.parametrize("where", ["another key", "another deployment", "another rank"])
def test_moved_block_does_not_open_even_with_a_genuine_header(where):
    """Whoever holds the directory's secret (it sits next to the data) can forge a header for a
    copied block; the GCM tag, bound to the key, the fingerprint and the rank, still refuses it."""
    secret, payload = os.urandom(32), block_data(7, 0, 8192).numpy().tobytes()
    src = BlockCodec(secret, 0x1111, 0, Sealer(K1))
    hdr, ct, _ = _sealed(src, b"key-a", payload)
    dst = {"another key": src, "another deployment": BlockCodec(secret, 0x2222, 0, Sealer(K1)),
           "another rank": BlockCodec(secret, 0x1111, 1, Sealer(K1))}[where]
    key = b"key-b" if where == "another key" else b"key-a"
    record = bytes(hdr[48 + 5 + 8:48 + 5 + 8 + 36])
    forger = BlockCodec(secret, dst.fp_hash, dst.rank, _AsIs(record))
    fhdr, fct, ftag = _sealed(forger, key, bytes(ct[:len(payload)]))
    assert dst.check(fhdr, key, ftag, memoryview(fct)[:len(payload)]) is None   # the header passes
    why = dst.unseal(fhdr, key, memoryview(fct))
    assert why is not None and why.startswith("cannot decrypt: does not authenticate")
    # unmoved, the same block opens
    buf = bytearray(ct)
    assert src.unseal(hdr, b"key-a", memoryview(buf)) is None and bytes(buf[:len(payload)]) == payload


def test_planted_block_without_the_key_does_not_open():
    secret, payload = os.urandom(32), os.urandom(4096)
    real = BlockCodec(secret, 1, 0, Sealer(K1))
    planted = BlockCodec(secret, 1, 0, Sealer(K2))  # the same secret, sealed with another key
    hdr, ct, tag = _sealed(planted, b"k", payload)
    assert real.check(hdr, b"k", tag, memoryview(ct)[:4096]) is None
    assert real.unseal(hdr, b"k", memoryview(ct)).startswith("cannot decrypt here: sealed with key id")


# ---- keys and the YAML ------------------------------------------------------------------------
def test_key_file_checks(tmp_path):
    assert read_key_file(key_file(tmp_path, "raw", K1)) == K1
    assert read_key_file(key_file(tmp_path, "hex", K1, hex_=True)) == K1
    assert read_key_file(key_file(tmp_path, "ro", K1, mode=0o400)) == K1
    p = key_file(tmp_path, "open", K1, mode=0o644)
    with pytest.raises(BadKey, match=f"{p}: mode 0644 lets other users read it; refused"):
        read_key_file(p)
    with pytest.raises(BadKey, match="not a 256-bit key"):
        read_key_file(key_file(tmp_path, "short", K1[:16]))
    with pytest.raises(BadKey, match="cannot open"):
        read_key_file(str(tmp_path / "absent"))


def test_yaml_encryption_field(tmp_path, capsys):
    base = {"block_bytes": BB, "tiers": [{"name": "cpu", "kind": "cpu", "capacity_blocks": 8}]}
    for enc, msg in (({"key_file": "a", "key_env": "B"}, "give key_file or key_env"), ({}, "give key_file"),
                     ({"key_env": "X", "read_keys": [{}]}, "give key_file")):
        with pytest.raises(ConfigError, match=msg):
            parse_config({**base, "tiers": base["tiers"] + [{"name": "n", "kind": "nvme", "path": str(tmp_path),
                                                              "capacity_blocks": 4, "encryption": enc}]},
                         check_env=False)
    with pytest.raises(ConfigError, match="encryption is for the persistent tiers"):
        parse_config({**base, "tiers": [{**base["tiers"][0], "encryption": {"key_env": "X"}}]}, check_env=False)
    # a key file open to others: the command fails with one line naming the file and its mode
    p = key_file(tmp_path, "k", K1, mode=0o640)
    rc = main(["spill", "--config", write_cfg(tmp_path, f"{{key_file: {p}}}"), "--blocks", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1 and f"{p}: mode 0640" in err[0] and "Traceback" not in err[0]


# ---- the shared tier on a real redis-server ------------------------------------------------
def _plane(url: str, sealer, model: str = "m") -> SharedData:
    s = RedisSettings(url=url, timeout_s=2.0, secret="fleet")
    return SharedData(s, Namespace({"model": model, "block_bytes": BB}, "fleet", 0, sealer), BB, threads=2)


@pytest.mark.parametrize("direct", [True, False])
def test_shared_tier_encrypted(redis_server, direct):
    keys = [f"enc-{direct}-{i}".encode() for i in range(6)]
    data = [block_data(9, i, BB) for i in range(6)]
    rd = _plane(redis_server.url, Sealer(K1))
    rd.direct_reads = direct
    assert rd.write((), data, keys).wait().all_ok
    cl = redis_server.client()
    stored = b"".join(cl.get(rd.ns.name(k)) for k in keys)
    assert not any(d.numpy().tobytes()[o:o + 32] in stored for d in data for o in (0, BB // 2))
    out = [torch.zeros(BB, dtype=torch.uint8) for _ in keys]
    assert rd.read((), out, keys).wait().all_ok and all(torch.equal(a, b) for a, b in zip(out, data))
    rd.close()
    # a wrong key: misses, a counter, the destination untouched, the values left for their readers
    wrong = _plane(redis_server.url, Sealer(K2))
    wrong.direct_reads = direct
    out = [torch.full((BB,), 7, dtype=torch.uint8) for _ in keys]
    r = wrong.read((), out, keys).wait()
    assert r.ok == [False] * 6 and all(r.bad) and all(torch.equal(o, torch.full((BB,), 7, dtype=torch.uint8)) for o in out)
    assert wrong.counters["decrypt_failed_blocks"] == 6 and "bad_deleted_blocks" not in wrong.counters
    assert all(cl.exists(wrong.ns.name(k)) for k in keys)
    wrong.close()
    # rotation: the new key reads them with the old one kept for reading
    rot = _plane(redis_server.url, Sealer(K2, [K1]))
    rot.direct_reads = direct
    out = [torch.zeros(BB, dtype=torch.uint8) for _ in keys]
    assert rot.read((), out, keys).wait().all_ok and all(torch.equal(a, b) for a, b in zip(out, data))
    # a value moved under another key's name, its header forged with the fleet's secret: refused
    # by the GCM tag, counted, deleted
    codec = rot.ns.codec
    v = cl.get(rot.ns.name(keys[0]))
    h = codec.header_size(keys[0])
    record = v[h - 36:h]
    forger = BlockCodec(codec.secret, codec.fp_hash, 0, _AsIs(record))
    fh = bytearray(codec.header_size(keys[1]))
    forger.seal(memoryview(fh), keys[1], memoryview(v)[h:], memoryview(bytearray(BB + 16)))
    cl.set(rot.ns.name(keys[1]), bytes(fh) + v[h:])
    out = [torch.full((BB,), 7, dtype=torch.uint8) for _ in keys[:2]]
    r = rot.read((), out, keys[:2]).wait()
    assert r.ok == [True, False] and torch.equal(out[1], torch.full((BB,), 7, dtype=torch.uint8))
    assert rot.counters["decrypt_failed_blocks"] == 1 and rot.counters["bad_deleted_blocks"] == 1
    assert not cl.exists(rot.ns.name(keys[1]))
    rot.close()
    # an unencrypted reader of the same namespace never hands ciphertext on
    plain = _plane(redis_server.url, None)
    plain.direct_reads = direct
    out = [torch.zeros(BB, dtype=torch.uint8) for _ in keys[2:]]
    r = plain.read((), out, keys[2:]).wait()
    assert r.ok == [False] * 4 and plain.counters["decrypt_failed_blocks"] == 4
    assert all(cl.exists(plain.ns.name(k)) for k in keys[2:])   # another reader's: left on the server
    # ... nor does an encrypted reader take a plaintext value (nor delete it)
    pk = [f"plain-{direct}".encode()]
    assert plain.write((), data[:1], pk).wait().all_ok
    plain.close()
    enc = _plane(redis_server.url, Sealer(K1))
    enc.direct_reads = direct
    r = enc.read((), [torch.zeros(BB, dtype=torch.uint8)], pk).wait()
    assert r.ok == [False] and enc.counters["decrypt_failed_blocks"] == 1 and cl.exists(enc.ns.name(pk[0]))
    enc.close()


# ---- the cost, in `kvtier bench` ----------------------------------------------------------------
def test_bench_has_encrypted_rows_in_the_same_run(tmp_path, capsys, redis_server):
    argv = ["bench", "--skip-cpu", "--sizes", "64KiB", "--total", "1MiB", "--repeat", "2", "--dir", str(tmp_path),
            "--redis", redis_server.url]
    rc, d = run_json(capsys, *argv)
    rows = {r["what"]: r for r in d["rows"]}
    assert rc == 0 and list(rows) == ["nvme spill (write)", "nvme restore (read)", "nvme spill encrypted",
                                      "nvme restore encrypted", "shared put", "shared put encrypted", "shared get",
                                      "shared get encrypted"]
    for w in ("nvme spill", "nvme restore"):
        assert rows[w + " encrypted"]["limit_gbps"] == rows[f"{w} ({'write' if 'spill' in w else 'read'})"]["ours_gbps"]
    assert all(r["ratio"] > 0 and r["ours_gbps"] > 0 for r in d["rows"])
    rc, d = run_json(capsys, *argv, "--skip-encrypted")
    assert rc == 0 and not any("encrypted" in r["what"] for r in d["rows"])


def test_flipped_ciphertext_is_detected_not_served(tmp_path, capsys):
    cfg = write_cfg(tmp_path, f"{{key_file: {key_file(tmp_path, 'k1', K1)}}}")
    assert run_json(capsys, "spill", "--config", cfg, "--blocks", "30", "--seed", "4")[0] == 0
    data = next((tmp_path / "nvme").rglob("data.0"))
    stride = 4096 + BB
    with open(data, "r+b") as f:
        for slot in (2, 11, 23):
            f.seek(slot * stride + 4096 + 999)
            b = f.read(1)
            f.seek(slot * stride + 4096 + 999)
            f.write(bytes([b[0] ^ 0x01]))
    rc, r = run_json(capsys, "restore", "--config", cfg, "--verify")
    r = r["result"]
    assert rc == 1 and (r["restored"], r["corrupt"], r["decrypt_failed"], r["bad_served"]) == (27, 3, 3, 0)
    # fsck needs no key: it checks every header (a sealed payload is checked by its GCM tag, on read)
    rc, f = run_json(capsys, "fsck", "--config", write_cfg(tmp_path, None, "nokey.yaml"))
    assert rc == 0, f


def test_a_bad_key_fails_the_start_but_not_a_replay_without_data(tmp_path):
    from kvtier.core.builder import build_tier
    cfg = parse_config({"block_bytes": BB, "tiers": [
        {"name": "cpu", "kind": "cpu", "capacity_blocks": 8},
        {"name": "nvme", "kind": "nvme", "path": str(tmp_path / "n"), "capacity_blocks": 8,
         "encryption": {"key_env": "KVTIER_TEST_UNSET_KEY"}}]}, check_env=False)
    os.environ.pop("KVTIER_TEST_UNSET_KEY", None)
    for data in ("full", "control"):
        with pytest.raises(ConfigError, match=r"tiers\[nvme\].encryption.key_env "
                                              r"\$KVTIER_TEST_UNSET_KEY: not set"):
            build_tier(cfg, 1, data)
    build_tier(cfg, 1, "none").close()   # a replay without bytes needs no key
