"""Per-file digests of model weights, cached in the data directory so a restart re-reads nothing.

One JSON file, `weights-digests.json` (0600, in a 0700 directory: `private_files`), maps a weight file's real
path to its xxh3-128 digest and the (device, inode, size, mtime_ns, ctime_ns) it had when it
was read. An entry is used only when all five still match the open file; anything else (another
inode, a write, `touch`, a copy over it) re-hashes. A cache file that does not parse, has
another shape, or is not a regular file of this user is ignored (everything re-hashed) and
replaced; it is never trusted blindly. A data directory kvtier may not write in (a symlink,
another user's, writable by others) is one warning, and every file is hashed again.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
from typing import Callable

import xxhash

from .private_files import PrivateDir, pid_alive

log = logging.getLogger("kvtier")

CACHE_FILE = "weights-digests.json"
CACHE_VERSION = 1
READ_BYTES = 8 << 20
MAX_BYTES = 64 << 20
_HEX = set("0123456789abcdef")


def stat_key(st: os.stat_result) -> list[int]:
    """What must not change for a cached digest to stand."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def default_data_dir() -> str:
    """$KVTIER_DATA_DIR, else $XDG_CACHE_HOME/kvtier, else ~/.cache/kvtier."""
    d = os.environ.get("KVTIER_DATA_DIR")
    if d:
        return os.path.expanduser(d)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvtier")


def data_dir_of(setting: str | None) -> str:
    """`serving.data_dir` (~ and $VARS expanded), else `default_data_dir()`."""
    if setting:
        from kvtier.core.config import expand_path
        return expand_path(setting)
    return default_data_dir()


class DigestCache:
    """The cache file under `data_dir` (None: no cache, every file hashed)."""

    def __init__(self, data_dir: str | None) -> None:
        self.dir = data_dir
        self.entries: dict[str, list] = {}
        self.ignored: str | None = None          # why the file on disk was not used
        self._refused = False                    # the directory is not kvtier's to write: said once (ignored)
        if data_dir is not None:
            self.entries = self._load()

    def _load(self) -> dict[str, list]:
        try:
            d = PrivateDir.open(self.dir, create=False)
        except FileNotFoundError:
            return {}
        except OSError as e:   # UnsafeDir: a symlink, another user's, writable by others
            self._refused = True
            self.ignored = f"{e.strerror or e}: the cache is neither read nor written there"
            return {}
        try:
            with d:
                raw = d.read(CACHE_FILE, MAX_BYTES)
        except OSError as e:   # UnsafeFile: a FIFO, a symlink, another user's, too big
            self.ignored = e.strerror or str(e)
            return {}
        if raw is None:
            return {}
        try:
            doc = json.loads(raw)
            if doc.get("version") != CACHE_VERSION or not isinstance(doc.get("files"), dict):
                raise ValueError("another version or shape")
            out = {}
            for p, e in doc["files"].items():
                if (isinstance(e, list) and len(e) == 6 and all(type(v) is int for v in e[:5])
                        and isinstance(e[5], str) and len(e[5]) == 32 and set(e[5]) <= _HEX):
                    out[p] = e
                else:
                    raise ValueError(f"bad entry for {p!r}")
            return out
        except (ValueError, AttributeError, TypeError) as e:
            self.ignored = f"not a digest cache ({e})"
            return {}

    def lookup(self, path: str, st: os.stat_result) -> str | None:
        e = self.entries.get(path)
        return e[5] if e is not None and e[:5] == stat_key(st) else None

    def put(self, path: str, st: os.stat_result, digest: str) -> None:
        self.entries[path] = stat_key(st) + [digest]

    def save(self) -> str | None:
        """Write the cache (0600, renamed into place, see `private_files`); the error text when it
        cannot. None also when its directory was refused at load (`ignored` said so: one warning)."""
        if self.dir is None or self._refused:
            return None
        self.entries = {p: e for p, e in self.entries.items() if os.path.exists(p)}   # files gone: dropped
        body = json.dumps({"version": CACHE_VERSION, "files": self.entries}, sort_keys=True).encode()
        try:
            with PrivateDir.open(self.dir) as d:
                d.remove_temps(pid_alive)
                d.write(CACHE_FILE, body, fsync=True)
        except OSError as e:
            return e.strerror or str(e)
        return None


def open_model_file(path: str) -> tuple[int, os.stat_result]:
    """(fd, its stat) of a model file: links followed, as vLLM does (hub snapshots are links),
    opened non-blocking so a FIFO planted in the model directory cannot stall the start; anything
    but a regular file is OSError EINVAL naming it."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", path)
    return fd, st


def file_digest(path: str, cache: DigestCache, on_bytes: Callable[[int], None]) -> tuple[str, int, bool]:
    """(xxh3-128 hex of the whole file at `path`, its size, whether it came from the cache: its
    stat still matches). `on_bytes(n)` is told every chunk read. Raises OSError naming the file."""
    fd, st = open_model_file(path)
    try:
        hit = cache.lookup(path, st)
        if hit is not None:
            return hit, st.st_size, True
        h = xxhash.xxh3_128()
        buf = bytearray(READ_BYTES)
        view = memoryview(buf)
        while True:
            n = os.readv(fd, [buf])
            if n == 0:
                break
            h.update(view[:n])
            on_bytes(n)
        digest = h.hexdigest()
        if stat_key(os.fstat(fd)) == stat_key(st):   # not written while we read it: worth keeping
            cache.put(path, st, digest)
        return digest, st.st_size, False
    finally:
        os.close(fd)
