"""Issue 9, case by case: the `kvtier` CLI in subprocesses on real files, driven the way an
operator's mistake, a bad disk or someone with write access to the data directory would.
Each test names its case; exact counts, no timing."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys

import pytest

BB = 65536
STRIDE = 4096 + BB   # header page + payload


def cfg(tmp_path, name="c.yaml", nvme_blocks=256, cpu="capacity_blocks: 8", model="m", policy="",
        path=None) -> str:
    p = tmp_path / name
    p.write_text(f"""
block_bytes: {BB}
model: {model}
tiers:
  - {{name: cpu, kind: cpu, {cpu}}}
  - {{name: nvme, kind: nvme, path: {path or tmp_path / 'nvme'}, capacity_blocks: {nvme_blocks}, io: posix}}
{policy}
""")
    return str(p)


def kv(*args, env=None, timeout=180, check_one_line=True):
    e = dict(os.environ, **(env or {}))
    r = subprocess.run([sys.executable, "-m", "kvtier", *args], capture_output=True, text=True, timeout=timeout,
                       env=e)
    assert "Traceback" not in r.stderr, r.stderr
    if r.returncode not in (0,) and check_one_line:
        errs = [ln for ln in r.stderr.splitlines() if ln.startswith("kvtier: error:")]
        assert len(errs) == 1, r.stderr
    return r


def js(r) -> dict:
    return json.loads(r.stdout.strip().splitlines()[-1])


def spill(c, n, seed=1, env=None, **kw):
    return kv("spill", "-c", c, "-n", str(n), "--seed", str(seed), "-q", "--json", env=env, **kw)


def verify(c, *extra):
    return kv("restore", "-c", c, "--verify", "-q", "--json", *extra)


# ---- 1. opening never destroys -------------------------------------------------------------
def test_case1_smaller_capacity_drops_nothing(tmp_path):
    big = cfg(tmp_path)
    small = cfg(tmp_path, "small.yaml", nvme_blocks=16)
    assert spill(big, 200).returncode == 0
    r = kv("inspect", "-c", small, "--json")
    nv = js(r)["tiers"][1]
    assert r.returncode == 0 and nv["beyond_capacity"] + nv["resident_blocks"] == 200
    r = spill(small, 5, seed=2)
    assert r.returncode == 2 and "beyond the configured capacity of 16" in r.stderr and "stores 200 blocks" in r.stderr
    r = verify(big)
    assert r.returncode == 0 and js(r)["verified_blocks"] == 200
    r = kv("fsck", "-c", small, "--rebuild", "--shrink", "--json")       # the explicit way to shrink
    assert r.returncode == 0 and (js(r)["rebuilt_entries"], js(r)["dropped_beyond_capacity"]) == (16, 184)
    assert spill(small, 5, seed=2).returncode == 0


def test_case11_read_only_commands_allocate_and_create_nothing(tmp_path):
    c = cfg(tmp_path, nvme_blocks=64)
    assert spill(c, 10).returncode == 0
    data = tmp_path / "nvme" / "data.0"
    size = data.stat().st_size
    huge = cfg(tmp_path, "huge.yaml", nvme_blocks=1 << 20, cpu="capacity: 100TiB")
    assert kv("inspect", "-c", huge).returncode == 0       # 100 TiB of DRAM: nothing allocated
    r = kv("restore", "-c", huge, "-q", "--json")
    assert r.returncode == 0 and js(r)["restored"] == 10
    assert data.stat().st_size == size                      # not preallocated to 1 Mi slots
    r = kv("inspect", "-c", cfg(tmp_path, "other.yaml", path=tmp_path / "none"))
    assert r.returncode == 0 and not (tmp_path / "none").exists()


# ---- 2. blocks bound to their identity -----------------------------------------------------
def _swap_entries(index_dir, pairs):
    import lmdb
    env = lmdb.open(str(index_dir), max_dbs=4)
    db = env.open_db(b"entries")
    with env.begin(write=True) as txn:
        keys = [k for k, _ in txn.cursor(db=db)]
        for a, b in pairs:
            va, vb = txn.get(keys[a], db=db), txn.get(keys[b], db=db)
            txn.put(keys[a], vb, db=db)
            txn.put(keys[b], va, db=db)
    env.close()


def test_case2_swapped_index_entries_are_misses(tmp_path):
    c = cfg(tmp_path)
    assert spill(c, 20).returncode == 0
    _swap_entries(tmp_path / "nvme" / "index", [(i, i + 10) for i in range(10)])
    r = verify(c)
    d = js(r)["result"]
    assert r.returncode == 1 and d["bad_served"] == 0 and d["corrupt"] == 20 and d["verified_blocks"] == 0


def test_case5_planted_block_from_another_directory_fails(tmp_path):
    a = cfg(tmp_path / "a" if (tmp_path / "a").mkdir() is None else None, path=tmp_path / "a" / "nvme")
    b = cfg(tmp_path / "b" if (tmp_path / "b").mkdir() is None else None, path=tmp_path / "b" / "nvme")
    assert spill(a, 4, seed=7).returncode == 0 and spill(b, 4, seed=7).returncode == 0
    # same keys, same bytes, same layout: only the secret differs. Plant a's slot 2 into b.
    with open(tmp_path / "a" / "nvme" / "data.0", "rb") as f:
        f.seek(2 * STRIDE)
        blob = f.read(STRIDE)
    with open(tmp_path / "b" / "nvme" / "data.0", "r+b") as f:
        f.seek(2 * STRIDE)
        f.write(blob)
    r = verify(b)
    d = js(r)["result"]
    assert r.returncode == 1 and (d["corrupt"], d["verified_blocks"], d["bad_served"]) == (1, 3, 0)
    secret = tmp_path / "b" / "nvme" / "secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600


# ---- 3. damaged index ----------------------------------------------------------------------
def test_case3_truncated_index_is_one_line_then_fsck_rebuilds(tmp_path):
    c = cfg(tmp_path)
    assert spill(c, 300).returncode == 0
    mdb = tmp_path / "nvme" / "index" / "data.mdb"
    os.truncate(mdb, mdb.stat().st_size // 2)
    for args in (("inspect", "-c", c), ("restore", "-c", c, "-q"), ("spill", "-c", c, "-n", "1", "-q")):
        r = kv(*args)
        assert r.returncode == 1 and "truncated" in r.stderr and str(mdb) in r.stderr, (args, r.returncode, r.stderr)
    r = kv("fsck", "-c", c, "--json")
    assert r.returncode == 1 and "index unusable" in js(r)["error"]["message"]
    r = kv("fsck", "-c", c, "--rebuild", "--json")
    assert r.returncode == 0 and js(r)["rebuilt_entries"] == 256 and js(r)["old_index_kept_at"]
    r = verify(c)
    assert r.returncode == 0 and js(r)["verified_blocks"] == 256  # 300 spilled into 256 slots


def test_case3_garbage_index_is_one_line(tmp_path):
    c = cfg(tmp_path)
    assert spill(c, 5).returncode == 0
    mdb = tmp_path / "nvme" / "index" / "data.mdb"
    mdb.write_bytes(os.urandom(3 * 4096))
    r = kv("restore", "-c", c)
    assert r.returncode == 1 and "damaged" in r.stderr and str(mdb) in r.stderr



def test_case3_fsck_with_another_fingerprint(tmp_path):
    """fsck under a config whose fingerprint differs checks the directory under the fingerprint
    it recorded (naming the fields the config differs in); without that record it refuses, exit
    2, naming the fields (as opening does). Neither touches the files."""
    c = cfg(tmp_path)
    assert spill(c, 5).returncode == 0
    other = cfg(tmp_path, "other.yaml", model="another-model")
    before = sorted((p.name, p.stat().st_size) for p in (tmp_path / "nvme").rglob("*"))
    r = kv("fsck", "-c", other, "--json")
    d = js(r)
    assert r.returncode == 0 and d["blocks_verified"] == 5 and d["config_differs_in"] == ["model"], r.stderr
    assert d["fingerprint"] == "the directory's record"
    r = kv("fsck", "--dir", str(tmp_path / "nvme"), "--json")      # no config at all
    assert r.returncode == 0 and js(r)["blocks_verified"] == 5
    (tmp_path / "nvme" / "fingerprint.json").unlink()                # a directory written before the record
    before = [b for b in before if b[0] != "fingerprint.json"]
    r = kv("fsck", "-c", other)
    assert r.returncode == 2 and "model: stored='m' ours='another-model'" in r.stderr, r.stderr
    assert sorted((p.name, p.stat().st_size) for p in (tmp_path / "nvme").rglob("*")) == before
    assert verify(c).returncode == 0 and js(verify(c))["verified_blocks"] == 5


def test_case3_removed_index_refuses_to_write_over_recoverable_blocks(tmp_path):
    """The index removed (or replaced by an empty one) while the data file holds blocks: opening
    for writing refuses, since new blocks would reuse slots that fsck --rebuild can still
    recover; after the rebuild every block verifies."""
    import shutil
    c = cfg(tmp_path, nvme_blocks=32)
    assert spill(c, 10).returncode == 0
    shutil.rmtree(tmp_path / "nvme" / "index")
    data = (tmp_path / "nvme" / "data.0").read_bytes()
    r = spill(c, 3, seed=9)
    assert r.returncode == 1 and "data.0 holds blocks" in r.stderr and "fsck --rebuild" in r.stderr, r.stderr
    assert (tmp_path / "nvme" / "data.0").read_bytes() == data          # nothing written
    r = kv("fsck", "-c", c, "--rebuild", "--json")
    assert r.returncode == 0 and js(r)["rebuilt_entries"] == 10
    r = verify(c)
    assert r.returncode == 0 and js(r)["verified_blocks"] == 10


def test_case3_lost_secret_is_refused_then_fsck_rebuild_starts_empty(tmp_path):
    """The block secret deleted: reading and writing opens refuse (a new secret would leave the
    indexed blocks unverifiable behind a silent start); fsck reports the blocks it cannot verify;
    fsck --rebuild keeps the old index aside and starts empty with a new secret."""
    c = cfg(tmp_path, nvme_blocks=32)
    assert spill(c, 10).returncode == 0
    (tmp_path / "nvme" / "secret").unlink()
    for r in (verify(c), spill(c, 2, seed=5)):
        assert r.returncode == 1 and "secret" in r.stderr and "fsck --rebuild" in r.stderr, r.stderr
    assert not (tmp_path / "nvme" / "secret").exists()
    r = kv("fsck", "-c", c, "--json")
    assert r.returncode == 1 and js(r)["error"]["message"].startswith("fsck: secret file missing: 10 indexed")
    r = kv("fsck", "-c", c, "--rebuild", "--json")
    assert r.returncode == 0 and js(r)["rebuilt_entries"] == 0 and js(r)["old_index_kept_at"]
    assert spill(c, 2, seed=5).returncode == 0
    r = verify(c)
    assert r.returncode == 0 and js(r)["verified_blocks"] == 2 and js(r)["corrupt"] == 0

# ---- 4. write errors -----------------------------------------------------------------------
@pytest.mark.parametrize("fault,errname", [("write:EIO:3", "EIO"), ("write:ENOSPC:2", "ENOSPC"),
                                           ("write:short:2", "ENOSPC"), ("fsync:EIO:2", "EIO")])
def test_case4_write_error_fails_spill_and_keeps_data(tmp_path, fault, errname):
    c = cfg(tmp_path)
    r = kv("spill", "-c", c, "-n", "64", "--batch", "8", "-q", env={"KVTIER_FAULT": fault})
    assert r.returncode == 1 and errname in r.stderr and "data.0" in r.stderr
    r = verify(c)  # the manifest lists exactly what is durable, and all of it verifies
    d = js(r)
    assert r.returncode == 0 and 0 < d["verified_blocks"] < 64 and d["corrupt"] == 0


def test_case4_cpu_copy_stays_when_the_nvme_write_fails(tmp_path, monkeypatch):
    """In process: the CPU tier keeps every block whose write-back failed."""
    from kvtier.offline.blockgen import block_data, block_key
    from kvtier.core.stack import TierStack
    from kvtier.tiers import io_engines
    c = cfg(tmp_path, nvme_blocks=64, policy="policy: {demotion: write_back}")
    with TierStack.from_config(c) as st:
        cpu, nvme = st.tiers
        keys = [block_key(1, j) for j in range(12)]
        st.put(keys[:8], [block_data(1, j, BB) for j in range(8)])  # fills the CPU tier (cleans ahead a few)
        before = {k for k in keys if k in nvme}
        monkeypatch.setattr(io_engines.HOOKS, "fault", ("write", "EIO", 1))
        monkeypatch.setattr(io_engines.HOOKS, "counts", {})
        with pytest.raises(OSError, match="EIO"):
            st.put(keys[8:], [block_data(1, j, BB) for j in range(8, 12)])  # needs write-back: fails
        assert all(k in cpu for k in keys[:8]) and {k for k in keys if k in nvme} == before
        assert not any(k in cpu or k in nvme for k in keys[8:]) and st.ctrl.totals["io_errors.nvme"] >= 1


# ---- 5. private, unfoolable files -----------------------------------------------------------
def test_case5_symlinked_data_file_is_refused(tmp_path):
    c = cfg(tmp_path)
    assert spill(c, 4).returncode == 0
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    data = tmp_path / "nvme" / "data.0"
    data.unlink()
    data.symlink_to(victim)
    r = spill(c, 4, seed=2)
    assert r.returncode == 1 and "symlink" in r.stderr and str(data) in r.stderr
    assert victim.read_bytes() == b"precious"
    r = kv("restore", "-c", c)
    assert r.returncode == 1 and "symlink" in r.stderr


def test_case5_modes_and_symlinked_directory(tmp_path):
    c = cfg(tmp_path)
    assert spill(c, 4).returncode == 0
    d = tmp_path / "nvme"
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    for f in ("data.0", "secret", "spill-manifest.json", "index/data.mdb", "index/lock.mdb"):
        assert stat.S_IMODE((d / f).stat().st_mode) == 0o600, f
    link = tmp_path / "link"
    link.symlink_to(d)
    r = kv("spill", "-c", cfg(tmp_path, "l.yaml", path=link), "-n", "1", "-q")
    assert r.returncode == 2 and "symlink" in r.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown")
def test_case5_foreign_owner_is_refused(tmp_path):
    c = cfg(tmp_path)
    assert spill(c, 4).returncode == 0
    os.chown(tmp_path / "nvme" / "data.0", 65534, 65534)
    r = kv("restore", "-c", c)
    assert r.returncode == 1 and "owned by uid 65534" in r.stderr


# ---- 6. one writer, really ------------------------------------------------------------------
HOLDER = """
import os, sys, time
from kvtier.core.stack import TierStack
st = TierStack.from_config(sys.argv[1])
print(os.getpid(), flush=True)
time.sleep(600)
"""

ORPHANER = """
import subprocess, sys
p = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE, text=True,
                     stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(p.stdout.readline().strip(), flush=True)   # the holder's pid; then this parent exits
"""


def test_case6_deleted_lock_file_cannot_admit_a_second_writer(tmp_path):
    c = cfg(tmp_path)
    assert spill(c, 4).returncode == 0
    p = subprocess.Popen([sys.executable, "-c", HOLDER, c], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(p.stdout.readline())
        for f in ("lock", "index/lock.mdb"):
            try:
                os.unlink(tmp_path / "nvme" / f)
            except FileNotFoundError:
                pass
        r = spill(c, 4, seed=2)
        assert r.returncode == 1 and f"in use by pid {pid}" in r.stderr
        r = kv("inspect", "-c", c, "--json", "--watch", "0.1", "--count", "3")   # issue 11 item 6: no lock
        assert r.returncode == 0 and len(r.stdout.splitlines()) == 3
        assert all(json.loads(ln)["tiers"][1]["resident_blocks"] == 4 for ln in r.stdout.splitlines())
    finally:
        p.kill()
        p.wait()


def test_case6_orphaned_holder_is_named(tmp_path):
    c = cfg(tmp_path)
    assert spill(c, 2).returncode == 0
    out = subprocess.run([sys.executable, "-c", ORPHANER, HOLDER, c], capture_output=True, text=True, timeout=120)
    pid = int(out.stdout.strip())
    try:
        r = spill(c, 2, seed=2)
        assert r.returncode == 1 and f"in use by pid {pid}" in r.stderr and f"kill {pid}" in r.stderr
        with open(f"/proc/{pid}/stat") as f:
            if int(f.read().rsplit(")", 1)[1].split()[1]) == 1:
                assert "orphaned" in r.stderr
    finally:
        os.kill(pid, signal.SIGKILL)


# ---- 7. honest verify -----------------------------------------------------------------------
def test_case7_verify_fails_on_wrong_seed_evicted_and_empty(tmp_path):
    c = cfg(tmp_path, nvme_blocks=64)
    r = verify(c)
    assert r.returncode == 1 and "no nvme tier" in js(r)["error"]["message"]      # empty: nothing there
    assert kv("restore", "-c", c, "--strict", "-q").returncode == 1
    assert spill(c, 20, seed=1).returncode == 0
    r = verify(c, "--seed", "2")                                                    # wrong seed
    assert r.returncode == 1 and "wrong seed 2" in js(r)["error"]["message"] and r.stdout.count("\n") == 1
    assert spill(c, 20, seed=2).returncode == 0          # recorded next to seed 1's (issue 19: it replaced it)
    r = verify(c, "--seed", "1")
    assert r.returncode == 0 and js(r)["verified_blocks"] == 20
    import lmdb
    env = lmdb.open(str(tmp_path / "nvme" / "index"), max_dbs=4)                   # 5 blocks evicted
    db = env.open_db(b"entries")
    from kvtier.offline.blockgen import block_key
    with env.begin(write=True) as txn:
        for j in range(5):
            assert txn.delete(block_key(2, j), db=db)
    env.close()
    r = verify(c, "--seed", "2")
    d = js(r)
    assert r.returncode == 1 and d["result"]["missing"] == 5 and d["result"]["verified_blocks"] == 15
    r = verify(c)
    assert r.returncode == 1 and js(r)["result"]["missing"] == 5 and js(r)["result"]["verified_blocks"] == 35


def test_case10_fifo_manifest_does_not_hang(tmp_path):
    c = cfg(tmp_path)
    assert spill(c, 2).returncode == 0
    m = tmp_path / "nvme" / "spill-manifest.json"
    m.unlink()
    os.mkfifo(m)
    r = kv("restore", "-c", c, "--verify", timeout=60)
    assert r.returncode == 1 and "not a regular file" in r.stderr


# ---- 8. keys ---------------------------------------------------------------------------------
def test_case8_spill_keys_never_collide_with_replay_ids():
    from kvtier.offline.blockgen import block_key
    from kvtier.core.keys import make_key
    spilled = {block_key(0, j) for j in range(4096)}
    replay = {make_key(h) for h in range(1 << 16)} | {make_key(h << 32 | j) for h in range(4) for j in range(4096)}
    assert not spilled & replay


# ---- 9. one line, never a traceback ----------------------------------------------------------
def test_case9_errors_are_one_line_with_exit_codes(tmp_path):
    c = cfg(tmp_path)
    assert spill(c, 2).returncode == 0
    r = spill(cfg(tmp_path, "m2.yaml", model="other"), 1)                           # FingerprintMismatch
    assert r.returncode == 2 and "model: stored='m' ours='other'" in r.stderr
    bad = {
        "inf.yaml": "block_bytes: 65536\ntiers: [{name: cpu, kind: cpu, capacity: .inf}]\n",
        "deep.yaml": "a: " + "[" * 5000 + "]" * 5000 + "\n",
        "alias.yaml": "a: &x [1, 2]\nb: [*x, *x]\ntiers: []\n",
        "param.yaml": "tiers: [{name: cpu, kind: cpu, capacity_blocks: 4}]\npolicy: {params: {lru: {bogus: 1}}}\n",
    }
    for name, text in bad.items():
        (tmp_path / name).write_text(text)
        r = kv("inspect", "-c", str(tmp_path / name), "--json")
        assert r.returncode == 2 and js(r)["error"]["exit"] == 2, (name, r.stderr)
    assert "bogus" in js(r)["error"]["message"]
    kvik = open(cfg(tmp_path, "k.yaml", path=tmp_path / "k")).read().replace("io: posix", "io: kvikio")
    (tmp_path / "kvik.yaml").write_text(kvik)
    r = kv("spill", "-c", str(tmp_path / "kvik.yaml"), "-n", "1", "-q")
    from kvtier.tiers.io_engines import cuda_driver_reason
    if cuda_driver_reason() is not None:
        assert r.returncode == 1 and "kvikio" in r.stderr
    r = spill(c, 1, seed=3)                                                          # a very short run
    assert r.returncode == 0


def test_case9_sigint_and_sigterm_stop_cleanly(tmp_path):
    c = cfg(tmp_path)
    # the signal lands while other writes from the spill's buffers are in flight: they must
    # finish before those buffers are freed (they were not: EFAULT, or SIGSEGV in the hash)
    for sig, code, k in (("INT", 130, 1), ("TERM", 143, 1), ("INT", 130, 3), ("TERM", 143, 3)):
        r = kv("spill", "-c", c, "-n", "64", "--batch", "8", "-q", "--seed", "5",
               env={"KVTIER_CRASH_AT": f"data_write:{k}", "KVTIER_CRASH_SIGNAL": sig})
        assert r.returncode == code and "index is consistent" in r.stderr, (sig, k, r.returncode, r.stderr)
        assert "EFAULT" not in r.stderr
    r = kv("restore", "-c", c, "-q", "--json")
    assert r.returncode == 0 and js(r)["corrupt"] == 0
    assert spill(c, 64, seed=5).returncode == 0          # the directory is usable: lock released, index whole
    r = verify(c)
    assert r.returncode == 0 and js(r)["verified_blocks"] == 64


def test_case10_dram_beyond_available_memory_is_refused_before_allocation(tmp_path):
    # beyond physical memory; and just below it (was accepted, then OOM-killed): always above what
    # is available less the headroom (>= 256 MiB), however the machine's free memory moves meanwhile
    below_physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") - (128 << 20)
    for cap in ("100TiB", str(below_physical)):
        r = kv("spill", "-c", cfg(tmp_path, cpu=f"capacity: {cap}"), "-n", "1", "-q")
        assert r.returncode == 2 and "tiers.0.capacity: tier 'cpu': asks" in r.stderr, r.stderr
        assert "available to it" in r.stderr and not (tmp_path / "nvme").exists()


# ---- issue 19: full and read-only file systems (a loop-mounted ext4 image) -------------------------
def _small_fs(size):
    sys.path.insert(0, os.path.dirname(__file__))
    from fs_util import small_fs
    return small_fs(size)


def _fill(path):
    with open(os.path.join(path, "filler"), "wb", buffering=0) as f:
        for n in (1 << 20, 4096, 512):
            while True:
                try:
                    f.write(b"\xa5" * n)
                except OSError:
                    break


def test_case11_disk_full_at_the_manifest_keeps_the_spill_verifiable(tmp_path, monkeypatch, capsys):
    """The file system fills after the blocks are committed: the spill fails naming the manifest's
    path and ENOSPC, leaves no temp file, and `restore --verify` still checks every block (against
    its key: the manifest keeps the spill as begun)."""
    from kvtier.cli import main, spill as spill_cmd
    with _small_fs("32M") as fs:
        c = cfg(tmp_path, nvme_blocks=64, path=f"{fs.path}/nv")
        real = spill_cmd.write_manifest

        def fill_then_write(nvme, spills):
            if spills[-1].get("digests") is not None:   # the final record, after the blocks are committed
                _fill(fs.path)
            return real(nvme, spills)
        monkeypatch.setattr(spill_cmd, "write_manifest", fill_then_write)
        assert main(["spill", "-c", c, "-n", "40", "--seed", "6", "-q"]) == 1
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("kvtier: error:")]
        assert len(err) == 1 and f"{fs.path}/nv/spill-manifest.json: [ENOSPC]" in err[0], err
        assert "40 blocks of seed 6 are committed on NVMe" in err[0]
        assert sorted(os.listdir(f"{fs.path}/nv")) == ["data.0", "fingerprint.json", "index", "kvtier-dir", "secret",
                                                       "spill-manifest.json"]   # no .tmp left
        monkeypatch.undo()
        r = verify(c)                                          # the disk is still full: reading needs no space
        d = js(r)
        assert r.returncode == 0 and (d["verified_blocks"], d["unrecorded"], d["seeds"]) == (40, 40, [6]), d
        os.unlink(os.path.join(fs.path, "filler"))
        assert spill(c, 10, seed=7).returncode == 0            # the begun record is completed from the index
        r = verify(c)
        assert r.returncode == 0 and (js(r)["verified_blocks"], js(r)["unrecorded"]) == (50, 0)


def test_case11_spill_onto_a_read_only_file_system_is_erofs(tmp_path):
    with _small_fs("16M") as fs:
        c = cfg(tmp_path, nvme_blocks=16, path=f"{fs.path}/nv")
        assert spill(c, 4).returncode == 0
        fs.remount(read_only=True)
        try:
            r = spill(c, 4, seed=2)
            assert r.returncode == 2 and "[EROFS]" in r.stderr and "EACCES" not in r.stderr, r.stderr
            r = verify(c)
            assert r.returncode == 0 and js(r)["verified_blocks"] == 4
        finally:
            fs.remount(read_only=False)


def test_case12_verify_from_a_shared_manifest_of_no_block_fails(tmp_path, redis_server):
    """admission second_hit keeps a one-off spill off the server: its manifest lists no block, and
    `restore --verify` from it is "nothing to verify" (was "0 of 0", exit 0, verified: true)."""
    yaml = tmp_path / "fleet.yaml"
    yaml.write_text(f"""
block_bytes: {BB}
model: second-hit-{os.getpid()}
tiers:
  - {{name: cpu, kind: cpu, capacity_blocks: 8}}
  - {{name: nvme, kind: nvme, path: "${{KVTIER_DATA}}", capacity_blocks: 64, io: posix}}
  - {{name: shared, kind: redis, url: "{redis_server.url}", admission: second_hit}}
""")
    r = kv("spill", "-c", str(yaml), "-n", "12", "--seed", "4", "-q", "--json",
           env={"KVTIER_DATA": str(tmp_path / "a")})
    assert r.returncode == 0 and js(r)["on_shared"] == 0 and "none of the 12 blocks reached shared tier" in r.stderr
    r = kv("restore", "-c", str(yaml), "--verify", "-q", "--json", env={"KVTIER_DATA": str(tmp_path / "b")})
    d = js(r)
    assert r.returncode == 1 and "nothing to verify" in d["error"]["message"] and d["result"]["verified"] is False
    assert r.stdout.count("\n") == 1
