"""An NVMe tier directory: the names of its files, the fingerprint that owns it, and its writer lock.

Layout under the tier's path (or ``path/ns-<fingerprint hash>`` in namespace mode): ``data.<rank>``
(the slots), ``index/`` (LMDB), ``secret`` and ``fingerprint.json`` (see `nvme_block`). The writer
holds a flock on the directory itself: one writer per directory, and deleting a file cannot defeat it.

kvtier writes only in a directory it owns (`claim_dir`): one it creates (missing parents too, each
0700), an empty one, or one holding its marker file ``kvtier-dir`` (or, written by an earlier
version, a 40-byte ``secret`` beside an ``index/`` of LMDB files); any other directory (``/``, a home
directory, anything with files of its own) is refused with one line naming it, nothing changed.
"""

from __future__ import annotations

import errno as _errno
import fcntl
import json
import os
import stat

import xxhash

from .nvme_block import FINGERPRINT_FILE, SECRET_FILE, UnsafePath, make_private_dirs, open_dir
from .nvme_index import FORMAT_VERSION


def data_file(rank: int = 0) -> str:
    """The data file of one rank's shards (``data.0`` for a single rank)."""
    return f"data.{rank}"


DATA_FILE = data_file(0)
INDEX_DIR = "index"
MARKER_FILE = "kvtier-dir"
MARKER = b"kvtier tier directory 1\n"


class ForeignDirectory(UnsafePath):
    """An existing directory kvtier did not write: refused, nothing in it changed."""


def _file_bytes(dir_fd: int, name: str, limit: int) -> bytes | None:
    """The content of regular file `name` owned by this user (None: absent, not one, too big)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size > limit:
            return None
        return os.read(fd, limit + 1)
    finally:
        os.close(fd)


def dir_owner(dir_fd: int) -> str | None:
    """Whose the directory is: "kvtier" (its marker), "earlier" (an earlier kvtier version's: a
    40-byte secret, an index/ with LMDB's data.mdb, fingerprint.json a JSON object if present),
    "empty", or None (someone else's)."""
    names = os.listdir(dir_fd)
    if not names:
        return "empty"
    if MARKER_FILE in names:
        return "kvtier" if _file_bytes(dir_fd, MARKER_FILE, 64) == MARKER else None
    secret = _file_bytes(dir_fd, SECRET_FILE, 64)
    try:
        idx = os.stat(INDEX_DIR, dir_fd=dir_fd, follow_symlinks=False)
        mdb = os.stat(os.path.join(INDEX_DIR, "data.mdb"), dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None
    if secret is None or len(secret) != 40 or not stat.S_ISDIR(idx.st_mode) or not stat.S_ISREG(mdb.st_mode):
        return None
    if FINGERPRINT_FILE in names:
        try:
            if not isinstance(json.loads(_file_bytes(dir_fd, FINGERPRINT_FILE, 1 << 16) or b""), dict):
                return None
        except ValueError:
            return None
    return "earlier"


def _write_marker(dir_fd: int, path: str) -> None:
    try:
        fd = os.open(MARKER_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=dir_fd)
    except FileExistsError:  # another process claiming the same new directory: it must be the marker
        if _file_bytes(dir_fd, MARKER_FILE, 64) != MARKER:
            raise ForeignDirectory(_errno.EEXIST, f"{os.path.join(path, MARKER_FILE)} is not kvtier's "
                                   f"marker; refused", path) from None
        return
    try:
        os.write(fd, MARKER)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.fsync(dir_fd)


def claim_dir(path: str, what: str = "nvme tier directory") -> int:
    """A directory fd for `path` that kvtier may write in: created 0700 (missing parents too) when
    absent; an existing one only when empty or already kvtier's (`dir_owner`), its marker then
    written and its mode narrowed to 0700. Any other is `ForeignDirectory`, nothing in it changed."""
    created = False
    if not os.path.lexists(path):
        try:
            make_private_dirs(os.path.dirname(path) or ".")
            os.mkdir(path, 0o700)
            created = True
        except FileExistsError:
            pass
        except OSError as e:
            raise oserror(e, f"cannot create {what}", path) from None
    fd = open_dir(path, what=what)
    try:
        owner = "empty" if created else dir_owner(fd)
        if owner is None:
            raise ForeignDirectory(_errno.EEXIST, f"{what} {path} exists and is not a kvtier directory (no "
                                   f"{MARKER_FILE} marker): refused, nothing in it changed; set a path kvtier "
                                   f"creates (e.g. a new subdirectory) or one it wrote", path)
        if owner != "kvtier":
            _write_marker(fd, path)
        if os.fstat(fd).st_mode & 0o077:
            os.fchmod(fd, 0o700)
    except BaseException:
        os.close(fd)
        raise
    return fd


def exists_at(dir_fd: int, name: str) -> bool:
    """Whether `name` exists in the directory of `dir_fd` (a symlink counts: it is not followed)."""
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False


def oserror(e: OSError, what: str, path: str) -> OSError:
    """`e` again, its message naming what failed, the path and the errno."""
    name = _errno.errorcode.get(e.errno, str(e.errno)) if e.errno else "?"
    return OSError(e.errno, f"{what} {path}: [{name}] {e.strerror}", path)


# ---- fingerprint ---------------------------------------------------------------------------
class FingerprintMismatch(RuntimeError):
    """The tier directory holds blocks written under another fingerprint."""

    def __init__(self, path: str, diffs: dict[str, tuple[object, object]]) -> None:
        self.path = path
        self.diffs = diffs
        parts = ", ".join(f"{k}: stored={a!r} ours={b!r}" for k, (a, b) in sorted(diffs.items()))
        super().__init__(f"nvme tier at {path} was written with another fingerprint ({parts}); "
                         f"set `on_fingerprint_mismatch: namespace` on the nvme tier (the vLLM connector's "
                         f"kv_connector_extra_config: \"nvme_on_mismatch\": \"namespace\") to keep both, or use "
                         f"another path")


def fingerprint_hash(fp: dict) -> str:
    return xxhash.xxh3_64_hexdigest(json.dumps(fp, sort_keys=True).encode())


def fingerprint_diff(stored: dict, ours: dict) -> dict[str, tuple[object, object]]:
    return {k: (stored.get(k), ours.get(k)) for k in set(stored) | set(ours) if stored.get(k) != ours.get(k)}


def make_fingerprint(name: str, block_bytes: int, fingerprint: dict | None) -> dict:
    fp = dict(fingerprint or {})
    for k, v in (("block_bytes", block_bytes), ("format_version", FORMAT_VERSION)):
        if k in fp and fp[k] != v:
            raise ValueError(f"tier {name!r}: fingerprint field {k}={fp[k]!r} contradicts the tier's {v!r}")
        fp[k] = v
    return fp


# ---- the writer lock -----------------------------------------------------------------------
class DirectoryInUse(OSError):
    """Another process holds the directory's writer lock (the message names its pid)."""


def lock_dir(dir_fd: int, path: str, who: str) -> None:
    """flock the directory of `dir_fd` (no file to delete, released when the holder dies);
    a held lock is `DirectoryInUse` naming the holder. `who` opens the message ("nvme tier 'x'")."""
    try:
        fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = lock_holder(dir_fd)
        if holder is None:
            raise DirectoryInUse(e.errno, f"{who}: {path} is in use by another process "
                                 f"or tier (flock: {e.strerror})", path) from None
        pid, cmd = holder
        if pid == os.getpid():
            raise DirectoryInUse(e.errno, f"{who}: {path} is already open in this process "
                                 f"(pid {pid}); close the other tier first", path) from None
        orphan = " - an orphaned process (its parent exited), e.g. a vLLM engine left by a killed API server;" \
            if _ppid(pid) == 1 else ";"
        raise DirectoryInUse(e.errno, f"{who}: {path} is in use by pid {pid} ({cmd[:120]})"
                             f"{orphan} stop it (kill {pid}) or use another path; `kvtier inspect` "
                             f"reads it without the lock", path) from None


def lock_holder(fd: int) -> tuple[int, str] | None:
    """(pid, command line) of the process holding a flock on the file of `fd`, from /proc/locks."""
    st = os.fstat(fd)
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        if "->" in parts or len(parts) < 6 or parts[1] != "FLOCK":
            continue
        if parts[5] == want and parts[4].isdigit():
            pid = int(parts[4])
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as c:
                    cmd = c.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                cmd = "?"
            return pid, cmd
    return None


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None
