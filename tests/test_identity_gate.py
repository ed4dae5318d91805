"""The model's identity is a digest of its whole weights, cached per file; until it is known the
persistent tiers (NVMe, shared) neither serve nor take a block, and then open under it."""

from __future__ import annotations

import json
import os
import stat
import sys

import pytest

from kvtier.core.digest_cache import CACHE_FILE
from kvtier.core.identity import DigestStats, ModelIdentity, weights_digest
from kvtier.connector.scheduler import PersistentTiers
from kvtier.connector.scheduler import KVTierScheduler
from kvtier.core.builder import build_controller
from kvtier.core.config import parse_config

sys.path.insert(0, os.path.dirname(__file__))
from test_connector_nvme import H, step, worker  # noqa: E402
from test_connector_scheduler import BT, Req  # noqa: E402

MiB = 1 << 20


def _model(d, sizes=(3 * MiB, 1 * MiB)):
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text('{"hidden_size": 64}')
    for i, n in enumerate(sizes):
        (d / f"model-{i}.safetensors").write_bytes(os.urandom(n))
    return d


def test_digest_is_cached_per_file_and_a_restart_reads_nothing(tmp_path):
    m, data = _model(tmp_path / "m"), tmp_path / "data"
    st = DigestStats()
    d0, n = weights_digest(str(m), str(data), st)
    assert n == 2 and st.hashed == 2 and st.bytes == 4 * MiB
    cache = data / CACHE_FILE
    assert stat.S_IMODE(cache.stat().st_mode) == 0o600 and stat.S_IMODE(data.stat().st_mode) == 0o700
    st = DigestStats()
    assert weights_digest(str(m), str(data), st)[0] == d0
    assert (st.hashed, st.bytes) == (0, 0)                     # a restart re-reads nothing
    # one file rewritten in place with the same bytes: its ctime moved, so it alone is read again
    w = m / "model-1.safetensors"
    w.write_bytes(w.read_bytes())
    st = DigestStats()
    assert weights_digest(str(m), str(data), st)[0] == d0
    assert (st.hashed, st.bytes) == (1, 1 * MiB)
    # one byte changed, mtime put back as it was: ctime still gives it away
    before = w.stat()
    b = bytearray(w.read_bytes())
    b[MiB // 2] ^= 1
    w.write_bytes(bytes(b))
    os.utime(w, ns=(before.st_atime_ns, before.st_mtime_ns))
    st = DigestStats()
    assert weights_digest(str(m), str(data), st)[0] != d0 and st.hashed == 1


@pytest.mark.parametrize("bad", [b"{not json", b'{"version": 1, "files": {"x": [1, 2]}}', b"[]",
                                 b'{"version": 1, "files": {}}'])
def test_a_corrupt_or_planted_cache_is_never_trusted(tmp_path, bad, caplog):
    m, data = _model(tmp_path / "m"), tmp_path / "data"
    d0, _ = weights_digest(str(m), str(data))
    cache = data / CACHE_FILE
    doc = json.loads(cache.read_text())
    cache.write_bytes(bad)                                     # damaged, another shape, or emptied
    st = DigestStats()
    assert weights_digest(str(m), str(data), st)[0] == d0
    assert st.hashed == 2                                      # everything read again
    if bad != b'{"version": 1, "files": {}}':
        assert "digest cache ignored" in caplog.text
    assert json.loads(cache.read_text())["files"] == doc["files"]   # and replaced


def _cfg(tmp_path, redis_url=None):
    tiers = [{"name": "cpu", "kind": "cpu", "capacity_blocks": 8},
             {"name": "nvme", "kind": "nvme", "path": str(tmp_path / "nv"), "capacity_blocks": 16}]
    bb = 2 * H * BT * 64 * 4
    return parse_config({"block_bytes": bb, "block_tokens": BT, "tiers": tiers}, check_env=False)


def _gate(tmp_path, identity):
    cfg = _cfg(tmp_path)
    p = PersistentTiers(cfg, identity, lambda m: cfg.fingerprint(model=m or "?"), wait_s=0)
    s = KVTierScheduler(build_controller(cfg, p.build()), model_identity=identity.value)
    return p, s


def test_persistent_tiers_closed_until_the_digest_is_done(tmp_path, caplog):
    """A digest that has not finished (not started here: blocked) keeps the NVMe tier closed:
    its lookups miss, stores go to DRAM only and the NVMe copies are counted as skipped; once the
    digest is done the tier opens under the full fingerprint and takes blocks."""
    import logging
    caplog.set_level(logging.INFO, logger="kvtier")
    m = _model(tmp_path / "m")
    ident = ModelIdentity(str(m), data_dir=str(tmp_path / "data"), start=False)
    p, s = _gate(tmp_path, ident)
    assert p.closed == [1] and not s.tiers[1].ready and s.nvme_dir is None
    w, _ = worker(0)
    r = Req("a", list(range(4 * BT + 3)))
    assert s.lookup(r, 0) == 0
    s.on_alloc(r, [[1, 2, 3, 4, 5]], 0)
    meta = step(s, w, [("a", r.num_tokens, [1, 2, 3, 4, 5])])
    assert p.poll(s) is False                                   # still running
    assert meta.nvme_dir is None and not meta.copies and meta.model_identity is None
    assert s.totals["stored_blocks.cpu"] == 4 and s.totals["not_open_blocks.nvme"] == 4
    assert not os.path.exists(tmp_path / "nv")                  # nothing written under no fingerprint
    ident.run()                                                 # the digest finishes
    assert p.poll(s) is True and p.closed == [] and s.tiers[1].ready
    assert s.tiers[1].fingerprint["model"] == ident.value and ident.value.startswith("weights:")
    assert "persistent tiers open" in caplog.text and "GB/s" in caplog.text
    r2 = Req("b", list(range(100, 100 + 3 * BT + 1)))
    s.lookup(r2, 0)
    s.on_alloc(r2, [[6, 7, 8, 9]], 0)
    meta = step(s, w, [("b", r2.num_tokens, [6, 7, 8, 9])])
    assert meta.nvme_dir == s.tiers[1].dir and meta.model_identity == ident.value
    assert s.totals["stored_blocks.nvme"] == 3 and s.totals["not_open_blocks.nvme"] == 4
    s.close()
    w.close()


def test_model_identity_given_is_used_as_is_and_opens_at_once(tmp_path):
    m = _model(tmp_path / "m")
    ident = ModelIdentity(str(m), given="acme/llama-70b@2026-11", data_dir=str(tmp_path / "data"))
    assert ident.done.is_set() and ident.value == "acme/llama-70b@2026-11" and "given" in ident.how
    assert ident.stats.bytes == 0 and not (tmp_path / "data").exists()   # no weight read
    p, s = _gate(tmp_path, ident)
    assert p.closed == [] and s.tiers[1].ready
    assert s.tiers[1].fingerprint["model"] == "acme/llama-70b@2026-11"
    s.close()
    with pytest.raises(Exception, match="model_identity"):
        parse_config({"tiers": [{"name": "cpu", "kind": "cpu", "capacity_blocks": 1}],
                      "serving": {"model_identity": ""}}, check_env=False)
