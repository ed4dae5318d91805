"""kvtier's private files outside its NVMe directories: nothing another local user can plant or stall.

The run directory (server state, the start-refused handoff), the data directory (the weights'
digest cache) and the files kvtier leaves in an NVMe directory beside the tier's own (serving
stats, shutdown reports, the spill manifest) are opened here, by the rules of `tiers.nvme_dir`:

- A directory (`PrivateDir.open`) is created 0700 (missing parents too) when absent. An existing
  one is opened `O_DIRECTORY|O_NOFOLLOW` and checked on its fd: a directory of this user, not
  writable by group or others (kvtier never changes its mode; one it creates is 0700).
  With `parents=True` (the run and data directories, whose paths default to /tmp and ~/.cache)
  every directory above it, walked up through `..` from its fd, must belong to root or this user
  and be writable by no one else unless sticky (/tmp): no one else can swap a component.
  Anything else is `UnsafeDir`, one line naming the path and why; the caller serves without it.
- A file is written atomically (`write`): a temp file of a name no one can guess, created
  `O_CREAT|O_EXCL|O_NOFOLLOW|O_NONBLOCK` 0600 relative to the directory's fd, then renamed over
  the name (a symlink or FIFO planted there is replaced, never followed or opened).
- A file is read (`read`, `read_file`) `O_NOFOLLOW|O_NONBLOCK`, only when it is a regular file of
  this user no bigger than a cap: a FIFO, device or symlink never blocks or redirects a read.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from typing import Callable

from kvtier.tiers.nvme_block import make_private_dirs

TEMP_SUFFIX = ".tmp"
_RD = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_UP = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC   # walking up: search permission is enough


class UnsafeDir(OSError):
    """A directory kvtier will not write in (another owner, writable by others, a symlink, ...)."""


class UnsafeFile(OSError):
    """A file kvtier will not read: not a regular file of this user, or too big."""


def _ename(e: OSError) -> str:
    return f"[{errno.errorcode.get(e.errno or 0, e.errno)}] {e.strerror}"


def _trusted_chain(fd: int, path: str, depth: int = 1) -> None:
    """The directory `depth` levels above `fd` (0: `fd`'s own), and every one above it, belongs to
    root or this user and is writable by no one else unless sticky (/tmp); else UnsafeDir naming
    the first that is not. Walked through `..`: the directories the fd is really in."""
    cur, below = os.dup(fd), None
    try:
        for _ in range(depth):
            nxt = os.open("..", _UP, dir_fd=cur)
            os.close(cur)
            cur = nxt
        for up in range(depth, 4096):
            st = os.fstat(cur)
            if below is not None and (st.st_dev, st.st_ino) == (below.st_dev, below.st_ino):   # past the root
                return
            if st.st_uid not in (0, os.geteuid()) or (st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX):
                where = os.path.normpath(os.path.join(path, *[".."] * up))
                why = f"owned by uid {st.st_uid}" if st.st_uid not in (0, os.geteuid()) else \
                    f"writable by others (mode {stat.S_IMODE(st.st_mode):04o})"
                raise UnsafeDir(errno.EPERM, f"{path}: {where} is {why}: another user could swap what is in "
                                f"it; refused", path)
            nxt = os.open("..", _UP, dir_fd=cur)
            os.close(cur)
            cur, below = nxt, st
    finally:
        os.close(cur)


def _check_before_create(path: str) -> None:
    """The nearest existing directory above a missing `path`, and those above it, are trusted
    (`_trusted_chain`): nothing is created where another user could swap it."""
    p = os.path.dirname(path)
    while not os.path.lexists(p):
        p = os.path.dirname(p)
    try:
        fd = os.open(p, _UP)
    except OSError as e:
        raise UnsafeDir(e.errno, f"{path}: cannot create it in {p}: {_ename(e)}", path) from None
    try:
        _trusted_chain(fd, p, depth=0)
    except UnsafeDir as e:
        raise UnsafeDir(e.errno, e.strerror.replace(f"{p}: ", f"{path}: ", 1), path) from None
    finally:
        os.close(fd)


def _check_dir(fd: int, path: str) -> None:
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        raise UnsafeDir(errno.EPERM, f"{path}: owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}); "
                        f"refused", path)
    if st.st_mode & 0o022:
        raise UnsafeDir(errno.EPERM, f"{path}: writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}); "
                        f"refused (chmod 700 it, or name another directory)", path)


class PrivateDir:
    """An open directory of this user's that no one else can write in (see the module)."""

    def __init__(self, fd: int, path: str) -> None:
        self.fd = fd
        self.path = path

    @classmethod
    def open(cls, path: str, create: bool = True, parents: bool = True) -> PrivateDir:
        """The directory at `path`, created 0700 when absent and `create`; UnsafeDir when refused,
        FileNotFoundError when absent and not `create`."""
        path = os.path.abspath(path)
        if create and not os.path.lexists(path):
            if parents:
                _check_before_create(path)
            try:
                make_private_dirs(path)
            except OSError as e:
                raise UnsafeDir(e.errno, f"{path}: cannot create it: {_ename(e)}", path) from None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise
        except OSError as e:
            why = f"cannot open it: {_ename(e)}"
            if e.errno in (errno.ELOOP, errno.ENOTDIR):   # O_NOFOLLOW|O_DIRECTORY on a symlink: ENOTDIR
                why = "a symlink" if os.path.islink(path) else "not a directory"
            raise UnsafeDir(e.errno, f"{path}: {why}; refused", path) from None
        try:
            _check_dir(fd, path)
            if parents:
                try:
                    _trusted_chain(fd, path)
                except UnsafeDir:
                    raise
                except OSError as e:   # a directory above it not searchable
                    raise UnsafeDir(e.errno, f"{path}: cannot check the directories above it: {_ename(e)}",
                                    path) from None
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, path)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> PrivateDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def join(self, name: str) -> str:
        return os.path.join(self.path, name)

    def write(self, name: str, data: bytes, fsync: bool = False) -> str:
        """`data` as file `name` (0600): written to a fresh temp file, then renamed over `name`;
        its path. An OSError names the file; no temp file is left behind."""
        tmp = f".{name}.{os.getpid()}.{secrets.token_hex(8)}{TEMP_SUFFIX}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         0o600, dir_fd=self.fd)
        except OSError as e:
            raise OSError(e.errno, f"cannot write {self.join(name)}: {_ename(e)}", self.join(name)) from None
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                if fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
            if fsync:
                os.fsync(self.fd)
        except OSError as e:
            self.unlink(tmp)
            raise OSError(e.errno, f"cannot write {self.join(name)}: {_ename(e)}", self.join(name)) from None
        return self.join(name)

    def read(self, name: str, limit: int) -> bytes | None:
        """The content of file `name` (None: absent); UnsafeFile when it is not a regular file of
        this user or is over `limit` bytes. Never blocks (a FIFO is refused) nor follows a symlink."""
        return _read_at(self.fd, name, self.join(name), limit)

    def names(self) -> list[str]:
        return os.listdir(self.fd)

    def lstat(self, name: str) -> os.stat_result:
        return os.stat(name, dir_fd=self.fd, follow_symlinks=False)

    def unlink(self, name: str) -> bool:
        """Remove entry `name` (a symlink itself, never its target); whether it was removed."""
        try:
            os.unlink(name, dir_fd=self.fd)
            return True
        except OSError:
            return False

    def remove_temps(self, alive: Callable[[int], bool] | None = None) -> int:
        """Remove the temp files `write` left in processes that died (`alive(pid)` False; None:
        any process); how many."""
        n = 0
        for x in self.names():
            parts = x.split(".")
            if x.startswith(".") and x.endswith(TEMP_SUFFIX) and len(parts) >= 5 and parts[-3].isdigit() \
                    and len(parts[-2]) == 16 and (alive is None or not alive(int(parts[-3]))):
                n += self.unlink(x)
        return n


def _read_at(dir_fd: int | None, name: str, path: str, limit: int) -> bytes | None:
    try:
        fd = os.open(name, _RD, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise UnsafeFile(e.errno, f"{path}: " + ("a symlink; refused" if e.errno == errno.ELOOP else _ename(e)),
                         path) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFile(errno.EINVAL, f"{path}: not a regular file; refused", path)
        if st.st_uid != os.geteuid():
            raise UnsafeFile(errno.EPERM, f"{path}: owned by uid {st.st_uid}, not by this user; refused", path)
        if st.st_size > limit:
            raise UnsafeFile(errno.EFBIG, f"{path}: {st.st_size} bytes, over the {limit} expected; refused", path)
        chunks, left = [], limit + 1
        while left > 0:
            c = os.read(fd, min(left, 1 << 20))
            if not c:
                break
            chunks.append(c)
            left -= len(c)
        data = b"".join(chunks)
        if len(data) > limit:
            raise UnsafeFile(errno.EFBIG, f"{path}: grew over the {limit} bytes expected; refused", path)
        return data
    finally:
        os.close(fd)


def read_file(path: str, limit: int) -> bytes | None:
    """`PrivateDir.read` of a file named by its path (its last component not followed)."""
    return _read_at(None, path, path, limit)


def open_regular(path: str, flags: int, mode: int = 0o600) -> int:
    """os.open of a file named by the user (a trace): `O_NOFOLLOW|O_NONBLOCK`, and the fd only
    when it is a regular file of this user (else closed and UnsafeFile)."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise UnsafeFile(errno.EINVAL, f"{path}: not a regular file of this user; refused", path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
