"""The fingerprint names the weights by content: in-place changes are caught, copies agree."""

from __future__ import annotations

import os
import shutil

from kvtier.connector.identity import SAMPLE_BYTES, model_identity, weights_digest


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


def test_first_and_last_bytes_are_sampled(tmp_path):
    a = _model(tmp_path / "a")
    d0, n = weights_digest(str(a))
    assert n == 1
    w = a / "model.safetensors"
    for pos in (0, w.stat().st_size - 1):
        data = bytearray(w.read_bytes())
        data[pos] ^= 1
        w.write_bytes(bytes(data))
        assert weights_digest(str(a))[0] != d0
        data[pos] ^= 1
        w.write_bytes(bytes(data))
    assert weights_digest(str(a))[0] == d0


def test_small_files_and_hub_ids(tmp_path):
    a = _model(tmp_path / "a", size=SAMPLE_BYTES // 2)
    assert model_identity(str(a))[0].startswith("weights:")
    assert model_identity("org/model", "abc123") == ("org/model@abc123", "hub id")
    assert model_identity("org/model") == ("org/model@default", "hub id")


def test_unreadable_weights_fall_back_to_the_path(tmp_path, caplog):
    a = _model(tmp_path / "a")
    os.unlink(a / "model.safetensors")
    os.symlink(tmp_path / "missing", a / "model.safetensors")    # a dangling link: ENOENT on open
    ident, how = model_identity(str(a))
    assert ident == str(a) and "unreadable" in how
    assert "cannot read" in caplog.text and "model.safetensors" in caplog.text
