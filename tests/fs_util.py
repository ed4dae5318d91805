"""A small real file system for full-disk and read-only tests: an ext4 image, loop-mounted.

tmpfs hides ENOSPC (sparse files, posix_fallocate over free memory), so the tests that need a
disk to fill up or to turn read-only mount their own::

    with small_fs("32M") as fs:          # fs.path: the mount point, empty, owned by this user
        ...                              # fill it: writes fail with ENOSPC
        fs.remount(read_only=True)       # now EROFS (no file open for writing)
        fs.make_read_only()              # EROFS under open files too, as a disk error does
        fs.fill()                        # take every free block
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

from kvtier.common.units import parse_size


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

    def make_read_only(self) -> None:
        """Turn the file system read-only under its open files, as a disk error does (ext4's
        `trigger_fs_error` with `errors=remount-ro`; `remount,ro` refuses while a file is open for
        writing). Writes through descriptors already open then fail with EROFS. There is no way back."""
        dev = next(line.split()[0] for line in open("/proc/mounts") if line.split()[1] == self.path)
        knob = f"/sys/fs/ext4/{os.path.basename(dev)}/trigger_fs_error"
        if not os.path.exists(knob):
            _skip(f"this kernel has no {knob}")
        _run(self._sudo + ["sh", "-c", f"echo 1 > {knob}"])

    def fill(self, name: str = "filler") -> str:
        """Take every free block with one file; returns its path (delete it to free them)."""
        path = os.path.join(self.path, name)
        fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)
        try:
            free = self.free_bytes()
            while free > 0:
                try:
                    os.posix_fallocate(fd, os.fstat(fd).st_size, free)
                    break
                except OSError:
                    free -= 1 << 20
            with contextlib.suppress(OSError):  # whatever is left, a page at a time
                while True:
                    os.write(fd, b"\0" * 4096)
                    os.fsync(fd)
        finally:
            os.close(fd)
        return path


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
            _run(sudo + ["mount", "-o", "loop,errors=remount-ro", image, mnt])
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
