"""kvtier writes only in a directory it created or one of its own (marker, or an earlier version's
secret + index/): anything else (`/`, a home directory, a directory holding an unrelated `data.0`)
is refused with one line naming the path, and nothing in it changes, mode included."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.core.builder import build_tiers
from kvtier.core.config import load_config
from kvtier.policies import EVICTION
from kvtier.tiers.nvme import NvmeTier
from kvtier.tiers.nvme_data import NvmeData
from kvtier.tiers.nvme_dir import MARKER_FILE, ForeignDirectory

BB = 65536
KVTIER_FILES = {MARKER_FILE, "secret", "index", "data.0", "fingerprint.json", "spill-manifest.json"}


def snapshot(root: Path) -> dict:
    """Every entry under `root` (itself included): mode, size, content digest, mtime."""
    out = {}
    for p in [root, *sorted(root.rglob("*"))]:
        st = p.lstat()
        digest = hashlib.sha256(p.read_bytes()).hexdigest() if stat.S_ISREG(st.st_mode) else None
        out[str(p.relative_to(root))] = (st.st_mode, st.st_size, digest, st.st_mtime_ns)
    return out


def home_like(tmp_path: Path, name: str = "home") -> Path:
    """A user's directory (0755): dotfiles, notes, a subdirectory, and an unrelated 3000-byte data.0."""
    d = tmp_path / name
    d.mkdir()
    (d / ".bashrc").write_text("export PS1='$ '\n")
    (d / "notes.txt").write_text("mine\n")
    (d / "docs").mkdir()
    (d / "docs" / "a.md").write_text("# a\n")
    (d / "data.0").write_bytes(os.urandom(3000))
    for p in (d, d / "docs"):
        p.chmod(0o755)
    return d


def cfg(tmp_path: Path, path, name="c.yaml") -> str:
    p = tmp_path / name
    p.write_text(f"""
block_bytes: {BB}
model: m
tiers:
  - {{name: cpu, kind: cpu, capacity_blocks: 8}}
  - {{name: nvme, kind: nvme, path: "{path}", capacity_blocks: 64, io: posix}}
""")
    return str(p)


def kv(*args, timeout=180):
    r = subprocess.run([sys.executable, "-m", "kvtier", *args], capture_output=True, text=True, timeout=timeout)
    assert "Traceback" not in r.stderr, r.stderr
    return r


def tier(path, **kw) -> NvmeTier:
    return NvmeTier("nvme", str(path), 64, BB, EVICTION.get("lru")(64), io="posix", fingerprint={"model": "m"}, **kw)


def refused_line(r, path) -> None:
    errs = [ln for ln in r.stderr.splitlines() if ln.startswith("kvtier: error:")]
    assert len(errs) == 1 and str(path) in errs[0] and "not a kvtier directory" in errs[0], r.stderr
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    assert doc["error"]["exit"] == 2 and str(path) in doc["error"]["message"]


def test_a_home_like_directory_is_refused_and_unchanged(tmp_path):
    d = home_like(tmp_path)
    before = snapshot(d)
    with pytest.raises(ForeignDirectory, match=str(d)):
        tier(d)
    assert snapshot(d) == before                              # mode 0755 kept, no file added or grown


def test_an_unrelated_data0_is_kept_byte_for_byte(tmp_path):
    d = tmp_path / "cache"
    d.mkdir(mode=0o750)
    d.chmod(0o750)
    payload = os.urandom(3000)
    (d / "data.0").write_bytes(payload)
    r = kv("spill", "-c", cfg(tmp_path, d), "-n", "2", "-q", "--json")
    assert r.returncode == 2
    refused_line(r, d)
    assert (d / "data.0").read_bytes() == payload and sorted(os.listdir(d)) == ["data.0"]
    assert stat.S_IMODE(d.stat().st_mode) == 0o750


def test_cli_spill_refuses_a_home_like_directory(tmp_path):
    d = home_like(tmp_path)
    before = snapshot(d)
    for args in (["spill", "-n", "2"], ["fsck", "--rebuild"], ["restore"]):
        r = kv(args[0], "-c", cfg(tmp_path, d), *args[1:], "-q", "--json")
        if args[0] != "restore":
            assert r.returncode == 2, (args, r.stderr)
            refused_line(r, d)
        else:  # read-only: finds no index of its own there
            assert r.returncode == 1 and "no index" in r.stderr, r.stderr
        assert snapshot(d) == before, args


def test_cli_spill_at_root_is_refused_and_writes_nothing(tmp_path):
    """`path: /` (this machine's real root): exit 2 naming it, no kvtier file appears, mode kept."""
    root = Path("/")
    names, mode = set(os.listdir(root)), root.stat().st_mode
    assert not names & {MARKER_FILE, "secret", "index", "fingerprint.json"}
    r = kv("spill", "-c", cfg(tmp_path, "/"), "-n", "1", "-q", "--json")
    assert r.returncode == 2, r.stderr
    refused_line(r, "/")
    assert set(os.listdir(root)) == names and root.stat().st_mode == mode


def test_the_connectors_nvme_tier_refuses_a_foreign_directory(tmp_path):
    """The scheduler's control plane (index, lock) and the worker's data plane (data file) alike."""
    d = home_like(tmp_path)
    before = snapshot(d)
    conf = load_config(cfg(tmp_path, d), check_env=False)
    with pytest.raises(ForeignDirectory, match=str(d)):
        build_tiers(conf, "control", {"model": "m"})
    with pytest.raises(ForeignDirectory, match=str(d)):
        NvmeData(str(d), 64, BB, io="posix")
    assert snapshot(d) == before


def test_new_directories_and_missing_parents_are_created_private(tmp_path):
    d = tmp_path / "a" / "b" / "nvme"
    assert kv("spill", "-c", cfg(tmp_path, d), "-n", "2", "-q").returncode == 0
    for p in (tmp_path / "a", tmp_path / "a" / "b", d):
        assert stat.S_IMODE(p.stat().st_mode) == 0o700, p
    assert (d / MARKER_FILE).is_file() and stat.S_IMODE((d / MARKER_FILE).stat().st_mode) == 0o600
    assert kv("spill", "-c", cfg(tmp_path, d), "-n", "2", "--seed", "2", "-q").returncode == 0   # reopened
    assert kv("restore", "-c", cfg(tmp_path, d), "--verify", "-q").returncode == 0


def test_an_empty_existing_directory_is_taken(tmp_path):
    d = tmp_path / "mnt"
    d.mkdir()
    d.chmod(0o755)
    assert kv("spill", "-c", cfg(tmp_path, d), "-n", "2", "-q").returncode == 0
    assert (d / MARKER_FILE).is_file() and stat.S_IMODE(d.stat().st_mode) == 0o700


def test_an_earlier_versions_directory_reopens(tmp_path):
    """Written by kvtier before the marker existed (secret, index/, fingerprint.json, data.0): its
    blocks are served again and the marker is added; a directory whose marker is not kvtier's is refused."""
    d = tmp_path / "nvme"
    assert kv("spill", "-c", cfg(tmp_path, d), "-n", "3", "-q").returncode == 0
    (d / MARKER_FILE).unlink()
    assert {"secret", "index", "fingerprint.json", "data.0"} <= set(os.listdir(d))
    r = kv("restore", "-c", cfg(tmp_path, d), "--verify", "-q", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["verified_blocks"] == 3
    assert not (d / MARKER_FILE).exists()                     # a read-only open writes nothing
    (d).chmod(0o755)
    assert kv("spill", "-c", cfg(tmp_path, d), "-n", "3", "--seed", "2", "-q").returncode == 0
    assert (d / MARKER_FILE).read_bytes().startswith(b"kvtier")
    assert stat.S_IMODE(d.stat().st_mode) == 0o700            # kvtier's own: kept private
    (d / MARKER_FILE).write_bytes(b"someone else's\n")
    before = snapshot(d)
    with pytest.raises(ForeignDirectory, match=str(d)):
        tier(d)
    assert snapshot(d) == before


def test_a_directory_with_a_secret_but_no_index_is_not_taken(tmp_path):
    """A stray 40-byte `secret` alone is not an earlier kvtier directory."""
    d = tmp_path / "x"
    d.mkdir()
    (d / "secret").write_bytes(os.urandom(40))
    before = snapshot(d)
    with pytest.raises(ForeignDirectory):
        tier(d)
    assert snapshot(d) == before


def test_bench_nvme_scratches_in_a_directory_of_its_own(tmp_path):
    """`--dir` names where to measure: kvtier's files go in a temp directory it makes there; a
    `raw.bin` or `tier/` of the user's is left alone (they were deleted)."""
    from kvtier.cli.bench_nvme import run_nvme_bench
    d = home_like(tmp_path)
    (d / "raw.bin").write_bytes(b"user's")
    (d / "tier").mkdir()
    (d / "tier" / "keep").write_text("keep")
    before = snapshot(d)
    run_nvme_bench(str(d), 4096, 8, threads=1, repeats=1)
    after = snapshot(d)
    assert {k: v[:3] for k, v in after.items() if k} == {k: v[:3] for k, v in before.items() if k}
