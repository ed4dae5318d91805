"""A small real file system for full-disk and read-only tests: an ext4 image, loop-mounted.

tmpfs hides ENOSPC (sparse files, posix_fallocate over free memory), so the tests that need a
disk to fill up or to turn read-only mount their own::

    with small_fs("32M") as fs:          # fs.path: the mount point, empty, owned by this user
        ...                              # fill it: writes fail with ENOSPC
        fs.remount(read_only=True)       # now EROFS
        fs.free_bytes()

Needs root (or passwordless sudo) and loop devices; otherwise the test is skipped with the
reason. The image lives in a private temp dir and is unmounted (lazily, if a file is still
open) and deleted on exit.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from typing import Iterator

from kvtier.units import parse_size


class SmallFs:
    def __init__(self, path: str, image: str, sudo: list[str]) -> None:
        self.path = path
        self.image = image
        self._sudo = sudo

    def remount(self, read_only: bool) -> None:
        """Remount read-only (writes then fail with EROFS) or read-write again."""
        _run(self._sudo + ["mount", "-o", f"remount,{'ro' if read_only else 'rw'}", self.path])

    def free_bytes(self) -> int:
        return shutil.disk_usage(self.path).free


def _skip(reason: str):
    import pytest
    pytest.skip(f"needs a loop-mounted ext4 image: {reason}")


def _run(cmd: list[str]) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise OSError(f"{' '.join(cmd)}: exit {r.returncode}: {(r.stderr or r.stdout).strip()}")


def _sudo() -> list[str] | None:
    if os.geteuid() == 0:
        return []
    if shutil.which("sudo") and subprocess.run(["sudo", "-n", "true"], capture_output=True).returncode == 0:
        return ["sudo", "-n"]
    return None


@contextlib.contextmanager
def small_fs(size: str | int = "32M") -> Iterator[SmallFs]:
    """Mount a fresh ext4 file system of `size` bytes in a temp dir (see the module docstring)."""
    sudo = _sudo()
    if sudo is None:
        _skip("not root and no passwordless sudo")
    mkfs = shutil.which("mkfs.ext4") or next((p for p in ("/sbin/mkfs.ext4", "/usr/sbin/mkfs.ext4")
                                               if os.path.exists(p)), None)
    if mkfs is None:
        _skip("mkfs.ext4 not installed (e2fsprogs)")
    top = tempfile.mkdtemp(prefix="kvtier-smallfs-")
    image, mnt = os.path.join(top, "image"), os.path.join(top, "mnt")
    os.mkdir(mnt, 0o700)
    mounted = False
    try:
        with open(image, "wb") as f:
            f.truncate(parse_size(size))
        try:
            _run([mkfs, "-q", "-F", "-m", "0", image])
            _run(sudo + ["mount", "-o", "loop", image, mnt])
        except OSError as e:
            _skip(str(e))
        mounted = True
        _run(sudo + ["chown", f"{os.getuid()}:{os.getgid()}", mnt])
        os.chmod(mnt, 0o700)
        shutil.rmtree(os.path.join(mnt, "lost+found"), ignore_errors=True)  # an empty directory to start
        yield SmallFs(mnt, image, sudo)
    finally:
        if mounted:
            try:
                _run(sudo + ["umount", mnt])
            except OSError:
                subprocess.run(sudo + ["umount", "-l", mnt], capture_output=True, timeout=60)
        shutil.rmtree(top, ignore_errors=True)
