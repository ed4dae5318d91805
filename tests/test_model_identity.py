"""The fingerprint names the weights by content: in-place changes are caught, copies agree."""

from __future__ import annotations

import os
import shutil

from kvtier.core.identity import model_identity, weights_digest


def _model(d, size=3 * 1024 * 1024, seed=1):
    os.makedirs(d, exist_ok=True)
    (d / "config.json").write_text('{"hidden_size": 64}')
    data = bytearray((i * 7 + seed) & 0xFF for i in range(size))
    (d / "model.safetensors").write_bytes(bytes(data))
    (d / "tokenizer.json").write_text("{}")
    return d


def test_copies_agree_and_in_place_changes_differ(tmp_path):
    a = _model(tmp_path / "a")
    b = tmp_path / "elsewhere" / "b"
    shutil.copytree(a, b)
    ia, how = model_identity(str(a))
    assert ia.startswith("weights:") and "1 weight files" in how
    assert model_identity(str(b))[0] == ia                 # same weights, another path
    # a fine-tune written in place: every sampled window changes
    w = a / "model.safetensors"
    data = bytearray(w.read_bytes())
    for off in range(0, len(data), 4096):
        data[off] ^= 0xFF
    w.write_bytes(bytes(data))
    assert model_identity(str(a))[0] != ia
    # the config alone
    (b / "config.json").write_text('{"hidden_size": 65}')
    assert model_identity(str(b))[0] != ia


def test_every_byte_counts(tmp_path):
    """Any byte of a weight file changes the identity: the first, the last, and one between
    where the old 16 x 64 KiB sampling never looked."""
    a = _model(tmp_path / "a")
    d0, n = weights_digest(str(a))
    assert n == 1
    w = a / "model.safetensors"
    size = w.stat().st_size
    between = (size - 64 * 1024) // 15 // 2 + 64 * 1024      # halfway between the first two old samples
    for pos in (0, between, size - 1):
        data = bytearray(w.read_bytes())
        data[pos] ^= 1
        w.write_bytes(bytes(data))
        assert weights_digest(str(a))[0] != d0
        data[pos] ^= 1
        w.write_bytes(bytes(data))
    assert weights_digest(str(a))[0] == d0


def test_small_files_and_hub_ids(tmp_path):
    a = _model(tmp_path / "a", size=32 * 1024)
    assert model_identity(str(a))[0].startswith("weights:")
    empty = str(tmp_path / "no-cache")
    assert model_identity("org/model", "abc123", cache_dir=empty) == ("org/model@abc123", "hub id (no cached snapshot)")
    assert model_identity("org/model", cache_dir=empty) == ("org/model@default", "hub id (no cached snapshot)")


def test_hub_ids_are_named_by_the_cached_snapshot(tmp_path):
    """A hub id resolves, through the local hub cache, to the commit of the snapshot vLLM loads:
    a new upstream commit is a new identity even though the name did not change."""
    repo = tmp_path / "hub" / "models--org--model"
    for commit in ("1111111111111111111111111111111111111111", "2222222222222222222222222222222222222222"):
        (repo / "snapshots" / commit).mkdir(parents=True)
        (repo / "snapshots" / commit / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("1" * 40)
    cache = str(tmp_path / "hub")
    assert model_identity("org/model", cache_dir=cache) == ("org/model@" + "1" * 40, "hub snapshot")
    (repo / "refs" / "main").write_text("2" * 40)      # the branch moved upstream
    assert model_identity("org/model", cache_dir=cache)[0] == "org/model@" + "2" * 40
    assert model_identity("org/model", "1" * 40, cache_dir=cache)[0] == "org/model@" + "1" * 40


def test_unreadable_weights_leave_the_identity_unknown(tmp_path, caplog):
    """Weights that cannot be read give no identity (the persistent tiers then stay closed), never
    an identity by path that would outlive the weights."""
    a = _model(tmp_path / "a")
    os.unlink(a / "model.safetensors")
    os.symlink(tmp_path / "missing", a / "model.safetensors")    # a dangling link: ENOENT on open
    ident, how = model_identity(str(a))
    assert ident is None and "unknown" in how
    assert "cannot read" in caplog.text and "model.safetensors" in caplog.text
