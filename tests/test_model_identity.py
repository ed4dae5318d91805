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


def test_small_files_and_hub_ids(tmp_path, caplog):
    a = _model(tmp_path / "a", size=32 * 1024)
    assert model_identity(str(a))[0].startswith("weights:")
    empty = str(tmp_path / "no-cache")
    ident, how = model_identity("org/model", "abc123", cache_dir=empty)
    assert ident is None and "hub id org/model@abc123 has no cached snapshot" in how
    assert model_identity("org/model", cache_dir=empty)[0] is None
    assert caplog.text.count("org/model@default has no cached snapshot") == 1


def _snapshot(repo, commit, weights):
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (snap / "model.safetensors").write_bytes(weights)
    return snap


def test_hub_ids_are_named_by_their_cached_snapshots_files(tmp_path):
    """A hub id names the files of the snapshot vLLM loads, through the local hub cache: a new
    upstream commit with other weights is another identity; the same files under another commit
    are the same weights."""
    repo = tmp_path / "hub" / "models--org--model"
    _snapshot(repo, "1" * 40, b"one" * 1000)
    _snapshot(repo, "2" * 40, b"two" * 1000)
    _snapshot(repo, "3" * 40, b"one" * 1000)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("1" * 40)
    cache = str(tmp_path / "hub")
    one, how = model_identity("org/model", cache_dir=cache)
    assert one.startswith("weights:") and "snapshots/" + "1" * 40 in how
    (repo / "refs" / "main").write_text("2" * 40)      # the branch moved upstream
    assert model_identity("org/model", cache_dir=cache)[0] not in (None, one)
    assert model_identity("org/model", "1" * 40, cache_dir=cache)[0] == one
    assert model_identity("org/model", "3" * 40, cache_dir=cache)[0] == one


def test_every_weight_format_is_named_by_its_bytes(tmp_path):
    """A single-file GGUF model (a path to a file, not a directory) is named by the file's bytes,
    not `<path>@default`: two files differ, a copy under another name agrees. A directory of
    .bin files is digested like one of .safetensors."""
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    b.write_bytes(b"GGUF" + bytes(range(255, -1, -1)) * 64)
    ia, ib = model_identity(str(a))[0], model_identity(str(b))[0]
    assert ia.startswith("weights:") and ib.startswith("weights:") and ia != ib
    c = tmp_path / "sub" / "copy.gguf"
    c.parent.mkdir()
    shutil.copy(a, c)
    assert model_identity(str(c))[0] == ia
    d = _model(tmp_path / "st", size=4096)
    e = tmp_path / "bin"
    e.mkdir()
    shutil.copy(d / "config.json", e / "config.json")
    (e / "pytorch_model.bin").write_bytes((d / "model.safetensors").read_bytes())
    idd, ie = model_identity(str(d))[0], model_identity(str(e))[0]
    assert idd and ie and idd != ie
    (e / "pytorch_model.bin").write_bytes(b"x" * 4096)
    assert model_identity(str(e))[0] not in (None, ie)


def test_what_kvtier_cannot_digest_leaves_the_identity_unknown(tmp_path, caplog):
    """A load format that does not read the model's files, or a path that does not resolve: no
    identity, one line naming it."""
    a = _model(tmp_path / "a", size=4096)
    for fmt in ("dummy", "tensorizer", "runai_streamer"):
        ident, how = model_identity(str(a), load_format=fmt)
        assert ident is None and f"load_format '{fmt}'" in how
        assert caplog.text.count(f"load_format '{fmt}'") == 1
    ident, how = model_identity(str(tmp_path / "missing"))
    assert ident is None and "does not resolve" in how


def test_a_symlink_flipped_during_the_start_closes(tmp_path, caplog):
    """The path is pinned once per engine: a symlink on it changed after the process started, or
    a path that resolves elsewhere after the digest than when pinned, leaves the identity unknown
    with one line naming the path and its targets."""
    from kvtier.core.identity import ModelIdentity, links_changed_since, pin
    v1, v2 = _model(tmp_path / "v1", size=4096), _model(tmp_path / "v2", size=4096, seed=2)
    link = tmp_path / "current"
    os.symlink(v1, link)
    assert links_changed_since(str(link), os.lstat(link).st_ctime - 60) is not None
    assert links_changed_since(str(link), os.lstat(link).st_ctime + 60) is None
    assert links_changed_since(str(v1), 0.0) is None
    p = pin("engine-a", str(link))
    assert p == pin("engine-a", str(link)) and p[0].target == os.path.realpath(v1)
    os.unlink(link)
    os.symlink(v2, link)                                      # the deploy flips it
    assert pin("engine-a", str(link)) == p                    # pinned once per engine
    mi = ModelIdentity(str(link), start=False, pinned=p)
    mi.run()
    assert mi.value is None and mi.done.is_set()
    line = [r.getMessage() for r in caplog.records if "resolved to" in r.getMessage()]
    assert len(line) == 1 and str(link) in line[0] and str(v1) in line[0] and str(v2) in line[0], line
    changed = pin("engine-b", str(link), since=os.lstat(link).st_ctime - 60)
    mi = ModelIdentity(str(link), start=False, pinned=changed)
    assert mi.value is None and mi.done.is_set() and "was changed at" in mi.how
    ok = ModelIdentity(str(link), start=False, pinned=pin("engine-c", str(link)))
    ok.run()
    assert ok.value == model_identity(str(v2))[0]


def test_unreadable_weights_leave_the_identity_unknown(tmp_path, caplog):
    """Weights that cannot be read give no identity (the persistent tiers then stay closed), never
    an identity by path that would outlive the weights."""
    a = _model(tmp_path / "a")
    os.unlink(a / "model.safetensors")
    os.symlink(tmp_path / "missing", a / "model.safetensors")    # a dangling link: ENOENT on open
    ident, how = model_identity(str(a))
    assert ident is None and "unknown" in how
    assert "cannot read" in caplog.text and "model.safetensors" in caplog.text


def test_a_fifo_in_the_model_directory_never_blocks(tmp_path, caplog):
    """A FIFO planted as config.json or as a weight file: no identity (closed), and the digest
    does not wait for a writer that never comes."""
    import threading
    for name in ("config.json", "model.safetensors"):
        d = _model(tmp_path / name.replace(".", "_"))
        os.unlink(d / name)
        os.mkfifo(d / name)
        out: list = []
        t = threading.Thread(target=lambda: out.append(model_identity(str(d))), daemon=True)
        t.start()
        t.join(30)
        if t.is_alive():   # free the reader so the test ends, then fail
            os.close(os.open(d / name, os.O_WRONLY | os.O_NONBLOCK))
            t.join(5)
        assert out, f"the digest blocked on a FIFO at {name}"
        ident, how = out[0]
        assert ident is None and "unknown" in how and name in caplog.text
