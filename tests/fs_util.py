"""A small real file system for full-disk and read-only tests: a loop-mounted ext4 image.

tmpfs takes sparse files (a preallocated data file costs nothing there) and hides ENOSPC, so
these tests need a real block file system. Mounting needs root and a loop device; without them
the test is skipped with the reason.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from typing import Iterator

import pytest


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True)


@contextlib.contextmanager
def small_ext4(size_mib: int = 24) -> Iterator[str]:
    """Mount a fresh ext4 image of `size_mib` MiB (no blocks reserved for root) and yield the
    mount point; unmounted and removed afterwards. Skips the test when it cannot be mounted."""
    if os.geteuid() != 0:
        pytest.skip("needs root to loop-mount a small ext4 file system")
    if shutil.which("mkfs.ext4") is None:
        pytest.skip("mkfs.ext4 not installed (Debian package e2fsprogs)")
    base = tempfile.mkdtemp(prefix="kvtier-fs-")
    img, mnt = os.path.join(base, "fs.img"), os.path.join(base, "mnt")
    os.mkdir(mnt)
    try:
        with open(img, "wb") as f:
            f.truncate(size_mib << 20)
        r = _run("mkfs.ext4", "-q", "-F", "-m", "0", img)
        if r.returncode != 0:
            pytest.skip(f"mkfs.ext4 failed: {r.stderr.strip()}")
        r = _run("mount", "-o", "loop,errors=remount-ro", img, mnt)
        if r.returncode != 0:
            pytest.skip(f"cannot loop-mount an ext4 image here: {r.stderr.strip()}")
        try:
            yield mnt
        finally:
            for _ in range(3):  # a process may still hold a file: lazy unmount as a last resort
                if _run("umount", mnt).returncode == 0:
                    break
            else:
                _run("umount", "-l", mnt)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def make_read_only(mnt: str) -> None:
    """Turn the mounted test file system read-only under its open files, as a disk error does:
    ext4's `trigger_fs_error` with `errors=remount-ro` (a plain `mount -o remount,ro` refuses while
    files are open for writing). Writes through descriptors already open then fail with EROFS."""
    dev = next(line.split()[0] for line in open("/proc/mounts") if line.split()[1] == mnt)
    knob = f"/sys/fs/ext4/{os.path.basename(dev)}/trigger_fs_error"
    if not os.path.exists(knob):
        pytest.skip(f"this kernel has no {knob}")
    with open(knob, "w") as f:
        f.write("1")


def fill(mnt: str, name: str = "filler") -> str:
    """Take every free block of the file system with one file; returns its path (delete it to free)."""
    path = os.path.join(mnt, name)
    free = shutil.disk_usage(mnt).free
    fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        step = 1 << 20
        while free > 0:
            try:
                os.posix_fallocate(fd, os.fstat(fd).st_size, free)
                break
            except OSError:
                free -= step
        with contextlib.suppress(OSError):  # whatever is left, a page at a time
            while True:
                os.write(fd, b"\0" * 4096)
                os.fsync(fd)
    finally:
        os.close(fd)
    return path
