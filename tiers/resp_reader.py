"""RESP replies read straight off a Redis connection's socket (the shared tier's fast GET path,
`shared_data.SharedData`): payloads land in the caller's memory without an intermediate bytes."""

from __future__ import annotations


class Redirected(Exception):
    """A cluster node answered MOVED / ASK."""


class RespReader:
    """RESP replies off a socket: lines through a small buffer, bulk payloads `recv_into` the
    caller's memory (what is already buffered first)."""

    def __init__(self, sock) -> None:
        self.sock = sock
        self.buf = bytearray(1 << 16)
        self.lo = self.hi = 0

    def _fill(self) -> None:
        if self.lo == self.hi:
            self.lo = self.hi = 0
        elif self.hi == len(self.buf):
            self.buf[:self.hi - self.lo] = self.buf[self.lo:self.hi]
            self.lo, self.hi = 0, self.hi - self.lo
        n = self.sock.recv_into(memoryview(self.buf)[self.hi:])
        if not n:
            raise ConnectionError("connection closed by the server")
        self.hi += n

    def line(self) -> bytes:
        while True:
            i = self.buf.find(b"\r\n", self.lo, self.hi)
            if i >= 0:
                out = bytes(self.buf[self.lo:i])
                self.lo = i + 2
                return out
            if self.hi - self.lo > 4096:
                raise ConnectionError("reply line too long")
            self._fill()

    def into(self, mv: memoryview) -> None:
        n = min(len(mv), self.hi - self.lo)
        mv[:n] = self.buf[self.lo:self.lo + n]
        self.lo += n
        while n < len(mv):
            got = self.sock.recv_into(mv[n:])
            if not got:
                raise ConnectionError("connection closed by the server")
            n += got

    def skip(self, n: int, digest=None) -> None:
        """Read past `n` bytes (fed to `digest` when given)."""
        while n > 0:
            if self.lo == self.hi:
                self._fill()
            k = min(n, self.hi - self.lo)
            if digest is not None:
                digest.update(memoryview(self.buf)[self.lo:self.lo + k])
            self.lo += k
            n -= k
