"""Encryption at rest for the persistent tiers: AES-256-GCM over each block's payload.

A `Sealer` holds the key a tier writes with and the keys it reads with (the write key, then
any old keys kept for rotation). Sealing a block encrypts its payload under a fresh 96-bit
random nonce, with the block's key, the deployment's fingerprint hash and the rank as
associated data, and gives a 36-byte record that the block's header carries: the key id
(8 bytes, a keyed hash of the key, never the key), the nonce (12) and the GCM tag (16). The
ciphertext is as long as the payload, so slots and values keep their sizes.

Opening fails (a reason, never an exception) for a block sealed under a key this tier does
not read, or one whose ciphertext, nonce, tag, key or deployment differ from what was sealed:
a block copied to another key's slot or into another deployment does not open.

Keys come from a file (32 raw bytes, or 64 hex digits and an optional newline; the file must
be a regular file of this user, readable by nobody else: mode 0600 or 0400) or from an
environment variable (64 hex digits).
"""

from __future__ import annotations

import hashlib
import os
import stat
from typing import Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

KEY_BYTES = 32
ID_BYTES, NONCE_BYTES, TAG_BYTES = 8, 12, 16
RECORD_BYTES = ID_BYTES + NONCE_BYTES + TAG_BYTES
FAILED = "cannot decrypt"   # every reason a block does not open starts with this (counted apart)
NOT_OURS = FAILED + " here"  # ... and these name a key or format this tier does not read: the
                             # block may be good for another reader, so a shared value stays


class BadKey(ValueError):
    """A key that cannot be used: the message is one line naming the file or variable."""


def key_id(key: bytes) -> bytes:
    """The 8-byte id a sealed block names its key by (a keyed hash: reveals nothing of the key)."""
    return hashlib.blake2b(b"kvtier block key id", key=key, digest_size=ID_BYTES).digest()


def _decode(raw: bytes, where: str) -> bytes:
    if len(raw) == KEY_BYTES:
        return raw
    text = raw.strip()
    if len(text) == 2 * KEY_BYTES:
        try:
            return bytes.fromhex(text.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            pass
    raise BadKey(f"{where}: expected a 256-bit key (32 raw bytes or 64 hex digits), got {len(raw)} bytes "
                    f"that are neither")


def read_key_file(path: str) -> bytes:
    """The key in `path`; refused unless it is a regular file of this user with mode 0600 or 0400."""
    where = f"encryption key file {path}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise BadKey(f"{where}: cannot open: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadKey(f"{where}: not a regular file; refused")
        if st.st_uid != os.geteuid():
            raise BadKey(f"{where}: owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}); refused")
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            raise BadKey(f"{where}: mode {mode:04o} lets other users read it; refused (chmod 600 {path})")
        raw = os.read(fd, 4 * KEY_BYTES)
    finally:
        os.close(fd)
    return _decode(raw, where)


def read_key_env(name: str) -> bytes:
    """The key in environment variable `name` (64 hex digits)."""
    v = os.environ.get(name)
    if not v:
        raise BadKey(f"encryption key variable ${name} is not set")
    return _decode(v.encode(), f"encryption key variable ${name}")


def load_key(key_file: str | None, key_env: str | None) -> bytes:
    return read_key_file(key_file) if key_file else read_key_env(key_env or "")


class Sealer:
    """Seals with `key`; opens blocks sealed with `key` or any of `read_keys`."""

    def __init__(self, key: bytes, read_keys: Sequence[bytes] = ()) -> None:
        for k in (key, *read_keys):
            if len(k) != KEY_BYTES:
                raise ValueError(f"AES-256 keys are {KEY_BYTES} bytes, got {len(k)}")
        self.key_id = key_id(key)
        self._aead = AESGCM(key)
        self._readers = {key_id(k): AESGCM(k) for k in (*read_keys, key)}

    @property
    def key_ids(self) -> list[str]:
        """The ids (hex) of the keys this sealer opens with, the write key's first."""
        return [self.key_id.hex()] + [k.hex() for k in self._readers if k != self.key_id]

    def seal_into(self, data, buf, aad: bytes) -> bytes:
        """Encrypt `data` into `buf[:len(data)]` (`buf` holds len(data) + TAG_BYTES; its tail is
        scratch, and `buf` may be `data`'s own memory); returns the block's record."""
        n = len(data)
        nonce = os.urandom(NONCE_BYTES)
        self._aead.encrypt_into(nonce, data, aad, buf)
        return self.key_id + nonce + bytes(buf[n:n + TAG_BYTES])

    def open_into(self, record, buf, aad: bytes, out=None) -> str | None:
        """Decrypt `buf[:-TAG_BYTES]` (writable, its last TAG_BYTES are scratch) into `out` (default:
        in place) with the `record` sealing gave. None when it opens, else why not."""
        kid = bytes(record[:ID_BYTES])
        aead = self._readers.get(kid)
        if aead is None:
            return (f"{NOT_OURS}: sealed with key id {kid.hex()}, not a key this tier reads "
                    f"(wrong key, or rotated without the old one in read_keys)")
        n = len(buf) - TAG_BYTES
        buf[n:] = record[ID_BYTES + NONCE_BYTES:RECORD_BYTES]
        try:
            aead.decrypt_into(bytes(record[ID_BYTES:ID_BYTES + NONCE_BYTES]), buf, aad,
                              out if out is not None else memoryview(buf)[:n])
        except InvalidTag:
            return (f"{FAILED}: does not authenticate under key id {kid.hex()} "
                    f"(a block moved to another key or deployment, planted or altered)")
        return None


def sealer_of(enc) -> Sealer | None:
    """The `Sealer` of a tier's `encryption` config (None when absent); a bad key: `BadKey`."""
    if enc is None:
        return None
    return Sealer(load_key(enc.key_file, enc.key_env), [load_key(k.key_file, k.key_env) for k in enc.read_keys])
