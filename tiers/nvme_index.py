"""The NVMe tier's persistent index: LMDB, key -> (slot, length, block tag, generation).

Two named databases in one environment:
- ``entries``: block key (bytes) -> ``<QQQQ`` packed (slot, length, checksum, generation), then,
  for a tier written by several ranks (tensor/pipeline parallel workers, each its own shard in
  its own data file), one ``<Q`` checksum per rank (``checksum`` is then rank 0's);
- ``meta``: ``format_version``, ``fingerprint`` (JSON), ``slot_stride``, ``capacity``, ``next_gen``;
- ``quarantine``: entries taken out of service (failed verification, did not fit), with why.
Writes are batched in one transaction each; the environment syncs on commit, so a returned
`put`/`delete` is durable. The map grows on `lmdb.MapFullError`.

`check_lmdb_file` reads the two meta pages of ``data.mdb`` before LMDB maps it: a file shorter
than its last page (truncated), or with no valid meta page, is an `NvmeIndexError` naming the
file, never a SIGBUS. `read_only` opens without writing anything (a live server's index).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import struct
from typing import Iterator, NamedTuple, Sequence

import lmdb

log = logging.getLogger("kvtier.nvme")

from kvtier import FORMAT_VERSION  # 2: keyed block headers, slot = header page + payload
_ENTRY = struct.Struct("<QQQQ")
_BYTES_PER_ENTRY = 1024  # generous: key + value + B-tree overhead at half-full pages


class Entry(NamedTuple):
    slot: int
    length: int
    checksum: int
    generation: int
    rank_sums: tuple[int, ...] = ()   # one checksum per rank when several ranks wrote shards

    @property
    def sums(self) -> int | tuple[int, ...]:
        """What a reader verifies against: the checksum, or one per rank."""
        return self.rank_sums if self.rank_sums else self.checksum


def _pack(slot: int, length: int, csum: int | Sequence[int], gen: int) -> bytes:
    if isinstance(csum, int):
        return _ENTRY.pack(slot, length, csum, gen)
    return _ENTRY.pack(slot, length, csum[0], gen) + struct.pack(f"<{len(csum)}Q", *csum)


def _unpack(v: bytes) -> Entry:
    if len(v) == _ENTRY.size:
        return Entry(*_ENTRY.unpack(v))
    n = (len(v) - _ENTRY.size) // 8
    return Entry(*_ENTRY.unpack_from(v), struct.unpack_from(f"<{n}Q", v, _ENTRY.size))


_FSCK = "`kvtier fsck --rebuild -c CONFIG`, or `--dir DIR` for a directory the vLLM connector wrote"


FULL_BYTES = 16 << 20   # a write that fails with this little free space failed for want of it


def _cause(path: str, e: lmdb.Error) -> tuple[int, str]:
    """(errno, reason) of an LMDB failure. LMDB turns a short write into EIO, and a full disk
    gives one: with less than FULL_BYTES free, the cause is reported as ENOSPC; on a read-only
    file system, as EROFS."""
    code = getattr(e, "code", None) or errno.EIO
    why = getattr(e, "reason", None) or str(e)
    probe = path
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    try:
        st = os.statvfs(probe)
    except OSError:
        return code, why
    if st.f_flag & os.ST_RDONLY:
        return errno.EROFS, "read-only file system"
    free = (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize
    if code in (errno.EIO, errno.ENOSPC) and free < FULL_BYTES:
        return errno.ENOSPC, f"no space left on device ({free} bytes free; LMDB said: {why})"
    return code, why


class NvmeIndexError(RuntimeError):
    """The index is unreadable or malformed (the message names the path and field)."""


_META_MAGIC = 0xBEEFC0DE


def check_lmdb_file(path: str) -> int:
    """Check ``path/data.mdb`` before mapping it; returns the bytes its meta pages need (0: no file).

    Raises NvmeIndexError naming the file when it is shorter than its newest meta page says
    (a truncated index would SIGBUS on access) or has no valid meta page."""
    f = os.path.join(path, "data.mdb")
    try:
        fd = os.open(f, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return 0
    except OSError as e:
        raise NvmeIndexError(f"index file {f}: cannot open: {e.strerror}") from None
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, 2 * 65536, 0)
    finally:
        os.close(fd)
    if size == 0:
        return 0
    best = None
    psize = struct.unpack_from("<I", head, 40)[0] if len(head) >= 152 else 0
    if psize < 512 or psize > 65536 or psize & (psize - 1):
        raise NvmeIndexError(f"index file {f} is damaged: {size} bytes, no valid LMDB meta page "
                             f"(run {_FSCK})")
    for off in (0, psize):
        if len(head) < off + 152:
            continue
        magic, ver = struct.unpack_from("<II", head, off + 16)
        last, txn = struct.unpack_from("<QQ", head, off + 136)
        if magic == _META_MAGIC and ver == 1 and (best is None or txn > best[1]):
            best = (last, txn)
    if best is None:
        raise NvmeIndexError(f"index file {f} is damaged: no valid LMDB meta page "
                             f"(run {_FSCK})")
    need = (best[0] + 1) * psize
    if size < need:
        raise NvmeIndexError(f"index file {f} is truncated: {size} bytes, its pages need {need} "
                             f"(run {_FSCK})")
    return need


class NvmeIndex:
    """LMDB environment at `path` (a directory); files created 0600."""

    def __init__(self, path: str, capacity: int, read_only: bool = False) -> None:
        self.path = path
        self.read_only = read_only
        need = check_lmdb_file(path)
        self._map_size = max(64 << 20, capacity * _BYTES_PER_ENTRY, need)
        try:
            if read_only:
                if need == 0:
                    raise NvmeIndexError(f"no index at {path}")
                try:  # a reader slot in lock.mdb, so a live writer does not reuse pages under us
                    self.env = lmdb.open(path, map_size=self._map_size, max_dbs=4, subdir=True, readonly=True,
                                         lock=True, readahead=False, create=False, mode=0o600)
                except lmdb.Error as e:
                    if "Permission denied" not in str(e) and "Read-only" not in str(e):
                        raise
                    self.env = lmdb.open(path, map_size=self._map_size, max_dbs=4, subdir=True, readonly=True,
                                         lock=False, readahead=False, create=False)
            else:
                self.env = lmdb.open(path, map_size=self._map_size, max_dbs=4, subdir=True, mode=0o600,
                                     sync=True, metasync=True, lock=True, readahead=False)
        except lmdb.Error as e:
            code, why = _cause(path, e)
            if code in (errno.EROFS, errno.ENOSPC, errno.EACCES, errno.EIO):
                raise OSError(code, f"cannot open LMDB index at {path}: [{errno.errorcode[code]}] {why}",
                              path) from None
            raise NvmeIndexError(f"cannot open LMDB index at {path}: {e}") from None
        try:
            self._entries = self._open_db(b"entries")
            self._meta = self._open_db(b"meta")
            self._quarantine = self._open_db(b"quarantine")
            self.max_key_size = self.env.max_key_size()
            self.next_gen = int(self.get_meta("next_gen") or 0)
        except (lmdb.Error, ValueError) as e:
            self.env.close()
            raise NvmeIndexError(f"index {path} is damaged: {e} (run {_FSCK})") from None

    def _open_db(self, name: bytes):
        if not self.read_only:
            return self.env.open_db(name)
        with self.env.begin() as txn:
            if txn.get(name) is None:
                return None
        return self.env.open_db(name, create=False)

    # ---- meta --------------------------------------------------------------------------
    def get_meta(self, name: str) -> str | None:
        if self._meta is None:
            return None
        with self.env.begin(db=self._meta) as txn:
            v = txn.get(name.encode())
        return None if v is None else v.decode()

    def set_meta(self, values: dict[str, object]) -> None:
        def fn(txn):
            for k, v in values.items():
                txn.put(k.encode(), (v if isinstance(v, str) else json.dumps(v, sort_keys=True)).encode(),
                        db=self._meta)
        self._write(fn)

    def fingerprint(self) -> dict | None:
        v = self.get_meta("fingerprint")
        if v is None:
            return None
        try:
            return json.loads(v)
        except ValueError as e:
            raise NvmeIndexError(f"index {self.path}: meta field 'fingerprint' is not JSON: {e}") from None

    # ---- entries -----------------------------------------------------------------------
    def put(self, items: Sequence[tuple[bytes, int, int, int | Sequence[int]]]) -> list[int]:
        """Insert (key, slot, length, checksum or one checksum per rank) in one durable txn;
        returns their generations."""
        gen0 = self.next_gen
        gens = list(range(gen0, gen0 + len(items)))

        def fn(txn):
            for (key, slot, length, csum), g in zip(items, gens):
                txn.put(key, _pack(slot, length, csum, g), db=self._entries)
            txn.put(b"next_gen", str(gen0 + len(items)).encode(), db=self._meta)
        self._write(fn)
        self.next_gen = gen0 + len(items)
        return gens

    def delete(self, keys: Sequence[bytes]) -> None:
        """Delete keys in one durable txn (absent keys are ignored)."""
        if not keys:
            return

        def fn(txn):
            for k in keys:
                txn.delete(k, db=self._entries)
        self._write(fn)

    def items(self) -> Iterator[tuple[bytes, Entry]]:
        """All entries (key order). Malformed values raise NvmeIndexError naming the key."""
        if self._entries is None:
            return
        with self.env.begin(db=self._entries, buffers=False) as txn:
            for k, v in txn.cursor():
                if len(v) < _ENTRY.size or (len(v) - _ENTRY.size) % 8 or len(v) == _ENTRY.size + 8:
                    raise NvmeIndexError(f"index {self.path}: entry {bytes(k).hex()} has {len(v)} bytes, "
                                         f"expected {_ENTRY.size} (+ 8 per rank, at least 2 ranks)")
                yield bytes(k), _unpack(v)

    def get(self, key: bytes) -> Entry | None:
        with self.env.begin(db=self._entries) as txn:
            v = txn.get(key)
        return None if v is None else _unpack(v)

    def __len__(self) -> int:
        if self._entries is None:
            return 0
        with self.env.begin(db=self._entries) as txn:
            return txn.stat(self._entries)["entries"]

    def quarantine(self, items: Sequence[tuple[bytes, str]]) -> None:
        """Move entries out of service in one durable txn, each with why (kept for `fsck`/forensics)."""
        if not items:
            return

        def fn(txn):
            for k, why in items:
                v = txn.get(k, db=self._entries)
                txn.delete(k, db=self._entries)
                rec = json.dumps({"entry": v.hex() if v is not None else None, "why": why})
                txn.put(k, rec.encode(), db=self._quarantine)
        self._write(fn)

    def quarantined(self) -> int:
        if self._quarantine is None:
            return 0
        with self.env.begin(db=self._quarantine) as txn:
            return txn.stat(self._quarantine)["entries"]

    def clear(self) -> None:
        self._write(lambda txn: txn.drop(self._entries, delete=False))

    # ---- plumbing ----------------------------------------------------------------------
    def _write(self, fn) -> None:
        if self.read_only:
            raise NvmeIndexError(f"index {self.path} is open read-only")
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    fn(txn)
                return
            except lmdb.MapFullError:
                self._map_size *= 2
                log.info("nvme index %s: map full, growing to %d MiB", self.path, self._map_size >> 20)
                self.env.set_mapsize(self._map_size)
            except lmdb.Error as e:  # nothing was committed
                code, why = _cause(self.path, e)
                raise OSError(code, f"index {self.path}: write failed: [{errno.errorcode.get(code, code)}] {why}",
                              self.path) from None

    def map_size(self) -> int:
        return self.env.info()["map_size"]

    def disk_bytes(self) -> int:
        return sum(os.path.getsize(os.path.join(self.path, f)) for f in os.listdir(self.path))

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
            self.env = None  # type: ignore[assignment]
