"""NVMe tier, block format and file safety: the keyed block header, the directory secret, and
opening files so that symlinks, foreign owners and other users cannot get in.

Each slot is a 4 KiB header page followed by the payload (padded to 4 KiB). The header holds a
magic, the format version, the block length, the fingerprint hash of the directory, the
payload's xxh3_64 (seeded from the secret), the key, and a tag: BLAKE2b keyed with the
directory's secret over all of those fields. The tag is what the index stores as the block's
checksum. A read checks the header against the key it expects and the tag the index holds,
and the payload against the hash in the header: a block in the wrong slot, a block of another
fingerprint or namespace, or a block planted without the secret fails, and is a miss.

The secret lives in ``secret`` (0600) next to the data: 32 random bytes then the 8-byte
fingerprint hash of the directory. Hashing the payload with seeded xxh3_64 runs at memory
speed; only the ~100-byte header goes through BLAKE2b (see docs/architecture.md for figures).

A tier whose engine moves device memory (`io: kvikio`) writes format 4: the payload's hash is
`block_sum.KeyedSum` (seeded from the secret), which torch computes on the GPU, so a block read
straight into device memory is verified there and a block written from device memory is hashed
there; everything else as format 2. Every plaintext tier reads formats 2 and 4 (`check` computes
either hash on host bytes).

An encrypted tier (`sealing.Sealer`) writes format 3: the payload is AES-256-GCM ciphertext
(same length), the header carries the sealing record after the key, and its payload-hash field
holds the GCM tag's first 8 bytes (so the header tag covers the ciphertext, with no second pass
over it). `check` verifies the header of either format (a sealed payload is verified by its GCM
tag: fsck needs no key, and checks headers only); `unseal` then refuses a block of the other
format (a plaintext block on an encrypted tier, or the reverse) and decrypts a sealed one.
"""

from __future__ import annotations

import errno as _errno
import hashlib
import json
import os
import stat
import struct

import torch
import xxhash

from .block_sum import KeyedSum
from .sealing import NOT_OURS, RECORD_BYTES, Sealer

HEADER_BYTES = 4096


def slot_stride(block_bytes: int) -> int:
    """Bytes per slot: the header page, then the payload padded to 4 KiB."""
    return HEADER_BYTES + (block_bytes + 4095) // 4096 * 4096

MAGIC = b"KVTBLK02"
SECRET_FILE = "secret"
_HDR = struct.Struct("<8sHHIQQQQ")   # magic, version, key_len, rank, length, fp_hash, payload_hash, tag
_TAGGED = _HDR.size - 8              # the tag covers every field before it, then the key
BLOCK_VERSION = 2
SEALED_VERSION = 3                   # the payload is encrypted (`sealing`)
DEVICE_VERSION = 4                   # the payload hash is `block_sum.KeyedSum` (torch, on any device)
PLAIN_VERSIONS = (BLOCK_VERSION, DEVICE_VERSION)
MAX_KEY_BYTES = HEADER_BYTES - _HDR.size


class UnsafePath(OSError):
    """A path of the tier is a symlink, not what it should be, or owned by another user."""


class NoSecret(OSError):
    """The directory's secret file is missing or malformed."""


# ---- files ---------------------------------------------------------------------------------
def _name(e: int) -> str:
    return _errno.errorcode.get(e, str(e))


def check_owned(st: os.stat_result, path: str, what: str, want_dir: bool) -> None:
    """Refuse a path that is not a directory / regular file, or that another user owns."""
    kind_ok = stat.S_ISDIR(st.st_mode) if want_dir else stat.S_ISREG(st.st_mode)
    if stat.S_ISLNK(st.st_mode) or not kind_ok:
        raise UnsafePath(_errno.ELOOP if stat.S_ISLNK(st.st_mode) else _errno.EINVAL,
                         f"{what} {path} is {'a symlink' if stat.S_ISLNK(st.st_mode) else 'not a ' + ('directory' if want_dir else 'regular file')}; refused",
                         path)
    if st.st_uid != os.geteuid():
        raise UnsafePath(_errno.EPERM, f"{what} {path} is owned by uid {st.st_uid}, not by this user "
                         f"(uid {os.geteuid()}); refused", path)


def make_private_dirs(path: str) -> None:
    """Create `path` and its missing parents, each 0700 (kvtier's directories are private)."""
    missing = []
    p = os.path.abspath(path)
    while not os.path.lexists(p):
        missing.append(p)
        p = os.path.dirname(p)
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass


def open_dir(path: str, what: str = "nvme tier directory") -> int:
    """A directory fd for an existing `path`; a symlink or another owner is refused (creating one,
    and writing in it, is `nvme_dir.claim_dir`'s: only in kvtier's own)."""
    try:
        st = os.lstat(path)
    except OSError as e:
        raise OSError(e.errno, f"{what} {path}: [{_name(e.errno)}] {e.strerror}", path) from None
    check_owned(st, path, what, want_dir=True)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise OSError(e.errno, f"cannot open {what} {path}: [{_name(e.errno)}] {e.strerror}", path) from None
    st = os.fstat(fd)
    try:
        check_owned(st, path, what, want_dir=True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_file(dir_fd: int, dir_path: str, name: str, flags: int, what: str) -> int:
    """Open `name` inside the directory `dir_fd` without following symlinks; created 0600; a file
    of another owner or not regular is refused; a file open to others is narrowed to 0600."""
    path = os.path.join(dir_path, name)
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == _errno.ELOOP:
            raise UnsafePath(e.errno, f"{what} {path} is a symlink; refused", path) from None
        raise OSError(e.errno, f"cannot open {what} {path}: [{_name(e.errno)}] {e.strerror}", path) from None
    return guard_file(fd, path, what, writable=bool(flags & (os.O_RDWR | os.O_WRONLY)))


def guard_file(fd: int, path: str, what: str, writable: bool) -> int:
    """`fd` when it is a regular file this user owns (else it is closed and refused); a writable
    one open to others is narrowed to 0600."""
    try:
        st = os.fstat(fd)
        check_owned(st, path, what, want_dir=False)
        if st.st_mode & 0o077 and writable:
            os.fchmod(fd, 0o600)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_tree(path: str, names: list[str]) -> None:
    """lstat each existing `path/name`: symlinks and foreign owners are refused (for files a
    library opens by path, such as LMDB's)."""
    for n in names:
        p = os.path.join(path, n)
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            continue
        check_owned(st, p, "index file", want_dir=stat.S_ISDIR(st.st_mode))


# ---- the directory's own fingerprint --------------------------------------------------------
FINGERPRINT_FILE = "fingerprint.json"


def record_fingerprint(dir_fd: int, dir_path: str, fp: dict) -> None:
    """Write `fingerprint.json` (0600, fsynced, renamed into place) unless a readable one is there:
    what the directory was written under, so `kvtier fsck` can check and rebuild it without the
    writer's config (the connector's fingerprint names vLLM's model, parallelism and KV dtype)."""
    if recorded_fingerprint(dir_fd, dir_path) is not None:
        return
    tmp = FINGERPRINT_FILE + ".tmp"
    try:
        os.unlink(tmp, dir_fd=dir_fd)  # a temp file of ours left by a crash (the directory is kvtier's)
    except FileNotFoundError:
        pass
    fd = open_file(dir_fd, dir_path, tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, "fingerprint file")
    try:
        os.write(fd, json.dumps(fp, sort_keys=True).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, FINGERPRINT_FILE, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    os.fsync(dir_fd)


def recorded_fingerprint(dir_fd: int, dir_path: str) -> dict | None:
    """The directory's `fingerprint.json` (None when absent or unreadable as JSON)."""
    try:
        fd = open_file(dir_fd, dir_path, FINGERPRINT_FILE, os.O_RDONLY, "fingerprint file")
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == _errno.ENOENT:
            return None
        raise
    try:
        raw = os.read(fd, 1 << 16)
    finally:
        os.close(fd)
    try:
        fp = json.loads(raw)
    except ValueError:
        return None
    return fp if isinstance(fp, dict) else None


# ---- secret --------------------------------------------------------------------------------
def load_secret(dir_fd: int, dir_path: str, fp_hash: int | None, create: bool) -> tuple[bytes, int]:
    """(secret, fingerprint hash) of the directory; created when `create` and absent. A stored
    fingerprint hash other than `fp_hash` (when given) is an error."""
    path = os.path.join(dir_path, SECRET_FILE)
    if create:
        try:
            fd = open_file(dir_fd, dir_path, SECRET_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, "secret file")
        except FileExistsError:
            fd = -1
        except OSError as e:
            if e.errno != _errno.EEXIST:
                raise
            fd = -1
        if fd >= 0:
            try:
                data = os.urandom(32) + struct.pack("<Q", fp_hash or 0)
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.fsync(dir_fd)
    try:
        fd = open_file(dir_fd, dir_path, SECRET_FILE, os.O_RDONLY, "secret file")
    except FileNotFoundError:
        raise NoSecret(_errno.ENOENT, f"secret file {path} is missing: blocks cannot be verified "
                       f"(`kvtier fsck --rebuild` starts the index empty; the old one is kept aside)", path) from None
    try:
        data = os.read(fd, 64)
    finally:
        os.close(fd)
    if len(data) != 40:
        raise NoSecret(_errno.EINVAL, f"secret file {path} holds {len(data)} bytes, expected 40", path)
    stored = struct.unpack_from("<Q", data, 32)[0]
    if fp_hash is not None and stored != fp_hash:
        raise NoSecret(_errno.EINVAL, f"secret file {path} belongs to fingerprint {stored:016x}, "
                       f"this tier is {fp_hash:016x}", path)
    return data[:32], stored


# ---- header --------------------------------------------------------------------------------
class BlockCodec:
    """Seals and checks block headers for one directory (its secret and fingerprint hash) and
    one rank's shard. `keys[i]` / `expect[i]`: the key and tag of block i of a batch. With a
    `sealer` the payloads are encrypted: `seal` needs `out`, reads call `unseal`. `device_sum`:
    write format 4 (the payload hash computable on a GPU, `payload_sum`)."""

    def __init__(self, secret: bytes, fp_hash: int, rank: int = 0, sealer: Sealer | None = None,
                 device_sum: bool = False) -> None:
        if sealer is not None and device_sum:
            raise ValueError("an encrypted block format has no device checksum")
        self.secret = secret
        self.fp_hash = fp_hash
        self.rank = rank
        self.sealer = sealer
        self.version = SEALED_VERSION if sealer is not None else DEVICE_VERSION if device_sum else BLOCK_VERSION
        self._aad = struct.pack("<QI", fp_hash, rank)
        self.seed = int.from_bytes(hashlib.blake2b(b"payload", key=secret, digest_size=8).digest(), "little")
        self.keyed_sum = KeyedSum(int.from_bytes(hashlib.blake2b(b"payload-sum", key=secret, digest_size=8)
                                                 .digest(), "little"))
        self._mac = hashlib.blake2b(key=secret, digest_size=8)  # keyed state, copied per tag

    def payload_hash(self, payload) -> int:
        """Format 2's payload hash: seeded xxh3_64 of host bytes."""
        return xxhash.xxh3_64_intdigest(payload, self.seed)

    def payload_sum(self, payload) -> int:
        """Format 4's payload hash (`block_sum.KeyedSum`): a tensor on its own device (no host
        copy), host bytes (a buffer) on the CPU."""
        if not isinstance(payload, torch.Tensor):
            mv = memoryview(payload).cast("B")
            payload = torch.frombuffer(mv if not mv.readonly else bytearray(mv), dtype=torch.uint8) \
                if len(mv) else torch.empty(0, dtype=torch.uint8)
        return self.keyed_sum(payload)

    def _tag(self, fixed: bytes, key: bytes) -> int:
        m = self._mac.copy()
        m.update(fixed)
        m.update(key)
        return int.from_bytes(m.digest(), "little")

    def seal(self, hdr: memoryview, key: bytes, payload, out=None) -> int:
        """Fill `hdr` (HEADER_BYTES) for `payload` under `key`; returns the tag. Encrypted: the
        ciphertext goes to `out[:len(payload)]` (`out` holds TAG_BYTES more, scratch; it may be
        the payload's own memory), and that is what is stored."""
        if len(key) > MAX_KEY_BYTES - 8 - RECORD_BYTES:  # before the sealer consumes a nonce
            raise ValueError(f"key of {len(key)} bytes exceeds {MAX_KEY_BYTES - 8 - RECORD_BYTES}")
        if self.sealer is not None:  # the payload's hash: its GCM tag's first 8 bytes (no second pass)
            record = self.sealer.seal_into(payload, out, key + self._aad)
            ph = struct.unpack_from("<Q", record, RECORD_BYTES - 16)[0]
        elif self.version == DEVICE_VERSION:
            record, ph = b"", self.payload_sum(payload)
        else:
            record, ph = b"", self.payload_hash(payload)
        return self.seal_hashed(hdr, key, len(payload), ph, record)

    def seal_hashed(self, hdr: memoryview, key: bytes, length: int, ph: int, record: bytes = b"") -> int:
        """Fill `hdr` for a payload of `length` bytes whose hash (of this codec's format) is `ph`,
        computed by the caller (format 4: on the payload's device); returns the tag."""
        if len(key) > MAX_KEY_BYTES - 8 - RECORD_BYTES:
            raise ValueError(f"key of {len(key)} bytes exceeds {MAX_KEY_BYTES - 8 - RECORD_BYTES}")
        fixed = _HDR.pack(MAGIC, self.version, len(key), self.rank, length, self.fp_hash, ph, 0)[:_TAGGED]
        tag = self._tag(fixed, key)
        n = _HDR.size
        hdr[:_TAGGED] = fixed
        hdr[_TAGGED:n] = struct.pack("<Q", tag)
        hdr[n:n + len(key)] = key
        hdr[n + len(key):n + len(key) + 8] = bytes(8)
        if record:
            hdr[n + len(key) + 8:n + len(key) + 8 + RECORD_BYTES] = record
        return tag

    def unseal(self, hdr, key: bytes, buf, out=None) -> str | None:
        """After `check` passed: None when the block is of this tier's format, decrypted when
        encrypted (`buf`: the stored payload then TAG_BYTES of scratch, writable; the plaintext
        goes to `out`, default in place); else why not (starting with `sealing.FAILED`)."""
        ver = struct.unpack_from("<H", hdr, 8)[0]
        if self.sealer is None:
            return None if ver in PLAIN_VERSIONS else \
                f"{NOT_OURS}: an encrypted block, this tier has no encryption key"
        if ver != SEALED_VERSION:
            return f"{NOT_OURS}: a plaintext block, this tier is encrypted"
        at = _HDR.size + len(key) + 8
        return self.sealer.open_into(bytes(hdr[at:at + RECORD_BYTES]), buf, key + self._aad, out)

    def parse(self, hdr) -> tuple[bytes, int, int] | str:
        """(key, length, tag) of a header whose tag is genuine, else why not."""
        b = bytes(hdr[:_HDR.size])
        magic, ver, klen, rank, length, fph, _ph, tag = _HDR.unpack(b)
        if magic != MAGIC:
            return "no block header (bad magic)"
        if ver not in (BLOCK_VERSION, SEALED_VERSION, DEVICE_VERSION):
            return f"block format {ver}, expected {BLOCK_VERSION}, {SEALED_VERSION} or {DEVICE_VERSION}"
        if klen > MAX_KEY_BYTES:
            return f"key length {klen} out of range"
        key = bytes(hdr[_HDR.size:_HDR.size + klen])
        if self._tag(b[:_TAGGED], key) != tag:
            return "header tag does not verify with this directory's secret (foreign or planted block)"
        if fph != self.fp_hash:
            return f"block of fingerprint {fph:016x}, this directory is {self.fp_hash:016x}"
        if rank != self.rank:
            return f"block of rank {rank}, this file is rank {self.rank}'s"
        return key, length, tag

    def header_size(self, key: bytes) -> int:
        """Bytes `seal` fills for `key` (a shared-tier value carries just these, then the payload)."""
        return _HDR.size + len(key) + 8 + (RECORD_BYTES if self.sealer is not None else 0)

    def verify(self, hdr, key: bytes, payload) -> str | None:
        """`check` without an index to hold the tag (the shared tier): the header must be genuine."""
        got = self.parse(hdr)
        if isinstance(got, str):
            return got
        return self.check(hdr, key, got[2], payload)

    def check_header(self, hdr, key: bytes, expect: int, length: int) -> str | tuple[int, int]:
        """(format, payload hash) when the header is genuine, names `key`, carries tag `expect`
        and a payload of `length` bytes (the payload itself unchecked); else why not."""
        got = self.parse(hdr)
        if isinstance(got, str):
            return got
        k, n, tag = got
        if k != key:
            return f"block belongs to key {k.hex()}, expected {key.hex()} (misdirected)"
        if tag != expect:
            return f"tag {tag:016x}, index expects {expect:016x} (stale or swapped entry)"
        if n != length:
            return f"block length {n}, expected {length}"
        return struct.unpack_from("<H", hdr, 8)[0], struct.unpack_from("<Q", bytes(hdr[_TAGGED - 8:_TAGGED]))[0]

    def check_payload(self, version: int, ph: int, payload) -> str | None:
        """None when `payload` (host bytes, or with format 4 a tensor on any device) matches the
        hash `ph` of its header's format `version`; else why not."""
        got = self.payload_sum(payload) if version == DEVICE_VERSION else self.payload_hash(payload)
        return None if got == ph else f"payload does not match its format-{version} hash (corrupt data)"

    def check(self, hdr, key: bytes, expect: int, payload) -> str | None:
        """None when the header is genuine, names `key`, carries tag `expect` and the payload
        matches its hash; else why not."""
        got = self.check_header(hdr, key, expect, len(payload))
        if isinstance(got, str):
            return got
        ver, ph = got
        if ver == SEALED_VERSION:  # its GCM tag: checked by `unseal`
            at = _HDR.size + len(key) + 8 + RECORD_BYTES - 16
            return None if bytes(hdr[at:at + 8]) == struct.pack("<Q", ph) else \
                "sealing record does not match its header (swapped or corrupt)"
        return self.check_payload(ver, ph, payload)
