"""The block I/O engine interface of the NVMe tier, and what every engine shares.

An engine moves whole blocks between memory buffers (uint8 torch tensors) and fixed,
aligned offsets of a file it opened. Each block's I/O size is its length rounded up to
`ALIGN`; optional per-block xxh3_64 checksums are computed (write) or verified (read) in the
I/O threads. The engines: `io_posix.PosixEngine`, `io_kvikio.KvikioEngine`; `io_engines.select_engine`
picks one.
"""

from __future__ import annotations

import errno as _errno
import os
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .handles import IOHandle, IOResult
from .io_hooks import HOOKS, crash_point

ALIGN = 4096
HEADER = 4096  # the block header page of a keyed write (see nvme_block)
MAX_IO_BYTES = 8 << 20  # bytes per preadv/pwritev call
_os_open = os.open  # patch point for tests (simulate a filesystem that refuses O_DIRECT)


def round_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


class EngineUnavailable(RuntimeError):
    """The asked-for I/O engine cannot run here (the message says why)."""


@dataclass
class EngineFile:
    """A file opened by an engine: `fd` (POSIX) or `handle` (kvikio CuFile)."""

    path: str
    fd: int
    direct: bool
    handle: object = None


class IOEngine:
    """Moves blocks between buffers and aligned file offsets; returns IOHandles."""

    name = "abstract"
    can_encrypt = True   # moves blocks through host memory, where `sealing` can encrypt them

    @property
    def description(self) -> str:
        return self.name

    def open(self, path: str, dir_fd: int | None = None, read_only: bool = False) -> EngineFile:
        """Open (create unless `read_only`) the file; with `dir_fd`, `path`'s base name is opened
        inside that directory without following a symlink, and a file another user owns is refused."""
        raise NotImplementedError

    def write(self, f: EngineFile, offsets: Sequence[int], buffers: Sequence[torch.Tensor], length: int,
              checksums: list[int] | None = None,
              finish: Callable[[IOResult], IOResult] | None = None, codec=None,
              keys: Sequence[bytes] | None = None) -> IOHandle:
        """Write `length` bytes of each buffer at offsets[i]; fill checksums[i] (xxh3_64) if given.

        With `codec` (a `nvme_block.BlockCodec`) and `keys`, each block is a sealed header page
        then the payload, and checksums[i] receives the header's tag.
        """
        raise NotImplementedError

    def read(self, f: EngineFile, offsets: Sequence[int], buffers: Sequence[torch.Tensor], length: int,
             expect: Sequence[int] | None = None, mismatched: list[bool] | None = None,
             finish: Callable[[IOResult], IOResult] | None = None, codec=None,
             keys: Sequence[bytes] | None = None) -> IOHandle:
        """Read `length` bytes at offsets[i] into buffers[i].

        With `expect`, ok[i] is False when the bytes' xxh3_64 differs from expect[i] (with a
        `codec`: when the header does not verify for keys[i] with tag expect[i]), and
        mismatched[i] (if given) is set True, telling corruption apart from I/O errors.
        """
        raise NotImplementedError

    def sync(self, f: EngineFile) -> None:
        """fdatasync the file; a failure raises OSError naming the path and errno."""
        if HOOKS.crash or HOOKS.fault:
            crash_point("fsync")
            if HOOKS.fault_for("fsync", HOOKS.tick("fsync")):
                raise OSError(_errno.EIO, f"fdatasync {f.path}: [EIO] injected fault", f.path)
        try:
            os.fdatasync(f.fd)
        except OSError as e:
            raise OSError(e.errno, f"fdatasync {f.path}: [{_errno.errorcode.get(e.errno, e.errno)}] "
                          f"{e.strerror}", f.path) from None

    def close_file(self, f: EngineFile) -> None:
        if f.fd >= 0:
            os.close(f.fd)
            f.fd = -1

    def close(self) -> None:
        pass

    def drain(self) -> None:
        """Wait for every transfer in flight (engines that track them)."""

    def reserve(self, stride: int, blocks: int) -> None:
        """Make now (at open) the host buffers that an encrypted tier's transfers of up to `blocks`
        slots of `stride` bytes go through, rather than in its first transfer (engines that bounce)."""

    def stats(self) -> dict:
        return {"engine": self.description}


def flat(t: torch.Tensor) -> torch.Tensor:
    """`t` as a 1-D uint8 tensor over the same memory."""
    if t.dtype != torch.uint8:
        t = t.reshape(-1).view(torch.uint8)
    return t.reshape(-1) if t.dim() != 1 else t


def check_buffers(offsets, buffers, length, codec=None, keys=None) -> list[torch.Tensor]:
    """The buffers as flat uint8 tensors, after checking counts, keys and sizes."""
    if len(offsets) != len(buffers):
        raise ValueError(f"{len(offsets)} offsets but {len(buffers)} buffers")
    if codec is not None and (keys is None or len(keys) != len(offsets)):
        raise ValueError("a keyed block write/read needs one key per block")
    out = []
    for i, b in enumerate(buffers):
        t = flat(b)
        if t.numel() < length:
            raise ValueError(f"buffer {i} holds {t.numel()} bytes, block length is {length}")
        out.append(t)
    return out


def open_in(path: str, flags: int, dir_fd: int | None) -> int:
    """open(2) of `path` (0600), or of its base name inside `dir_fd` with O_NOFOLLOW and an owner check."""
    if dir_fd is None:
        return _os_open(path, flags | os.O_CLOEXEC, 0o600)
    from .nvme_block import UnsafePath, guard_file
    try:
        fd = _os_open(os.path.basename(path), flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == _errno.ELOOP:
            raise UnsafePath(e.errno, f"data file {path} is a symlink; refused", path) from None
        raise
    return guard_file(fd, path, "data file", writable=(flags & os.O_ACCMODE) != os.O_RDONLY)
