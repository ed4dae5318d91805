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

Keys come from a file (exactly 32 raw bytes, not text; or exactly 64 hex digits and at most one
newline; the file must be a regular file of this user, readable by nobody else: mode 0600 or
0400) or from an environment variable (exactly 64 hex digits). Anything else (a passphrase, a
128-bit hex key, base64, an empty file) is refused with one line naming the field and the file
or variable, never a byte of the key.
"""

from __future__ import annotations

import hashlib
import os
import re
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


_HEX = re.compile(rb"[0-9A-Fa-f]{%d}" % (2 * KEY_BYTES))
_TEXT = re.compile(rb"[\x20-\x7e\t\r\n]*")
FILE_FORM = f"exactly {KEY_BYTES} raw bytes, or {2 * KEY_BYTES} hex digits and at most one newline"
ENV_FORM = f"exactly {2 * KEY_BYTES} hex digits"


def _one_newline_off(raw: bytes) -> bytes:
    return raw[:-2] if raw.endswith(b"\r\n") else raw[:-1] if raw.endswith(b"\n") else raw


def decode_key_file(raw: bytes) -> bytes | None:
    """The 256-bit key a key file's bytes hold, or None: 32 raw bytes (not text: 32 characters are
    a passphrase, or a hex key of 128 bits), or 64 hex digits and at most one newline."""
    if len(raw) == KEY_BYTES and not _TEXT.fullmatch(raw):
        return raw
    text = _one_newline_off(raw)
    return bytes.fromhex(text.decode("ascii")) if _HEX.fullmatch(text) else None


def decode_key_env(value: str) -> bytes | None:
    """The 256-bit key a variable holds (64 hex digits, at most one newline), or None."""
    text = _one_newline_off(value.encode("utf-8", "surrogateescape"))
    return bytes.fromhex(text.decode("ascii")) if _HEX.fullmatch(text) else None


def _what(raw: bytes) -> str:
    """What a refused key holds, by its shape alone (never a byte of it)."""
    body = _one_newline_off(raw)
    if not body:
        return "it is empty"
    if re.fullmatch(rb"[0-9A-Fa-f]+", body):
        return f"it holds {len(body)} hex digits"
    return f"it holds {len(raw)} bytes" + (" of text" if _TEXT.fullmatch(raw) else "")


def read_key_file(path: str, field: str = "encryption.key_file") -> bytes:
    """The key in `path`; refused unless it is a regular file of this user with mode 0600 or 0400
    holding a key in the one form (`decode_key_file`). `field`: the config field, for the message."""
    where = f"{field} {path}"
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
    key = decode_key_file(raw)
    if key is None:
        raise BadKey(f"{where}: not a 256-bit key ({_what(raw)}); expected {FILE_FORM}")
    return key


def read_key_env(name: str, field: str = "encryption.key_env") -> bytes:
    """The key in environment variable `name` (`decode_key_env`)."""
    v = os.environ.get(name)
    if v is None:
        raise BadKey(f"{field} ${name}: not set; expected {ENV_FORM}")
    key = decode_key_env(v)
    if key is None:
        raise BadKey(f"{field} ${name}: not a 256-bit key ({_what(v.encode('utf-8', 'surrogateescape'))}); "
                     f"expected {ENV_FORM}")
    return key


def load_key(key_file: str | None, key_env: str | None, field: str = "encryption") -> bytes:
    """The key of one `KeySource` (`field`: where it is in the config, e.g. encryption.read_keys[0])."""
    if key_file:
        return read_key_file(key_file, field + ".key_file")
    return read_key_env(key_env or "", field + ".key_env")


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
    return Sealer(load_key(enc.key_file, enc.key_env),
                  [load_key(k.key_file, k.key_env, f"encryption.read_keys[{i}]") for i, k in enumerate(enc.read_keys)])
