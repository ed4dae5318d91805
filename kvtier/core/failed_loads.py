"""Blocks whose load failed (`FailedLoads`, held by the controller): not offered until rewritten.

A load that fails for any reason (an I/O error such as EIO or EISDIR, a file that cannot be
opened, a short read, a failed verification or decryption, a shared-tier value gone or bad, a
copy into the KV that failed) is a load error, recomputed by vLLM, and its blocks' keys are
remembered here. The controller's lookups (`TierController.match`, `find`) end a hit at a
remembered key, on every tier, for every caller: a request vLLM sends back to the lookup after
a failed load (a hybrid model's or a shared-tier hit's asynchronous load) is not offered the same
blocks again. A fresh store of a key (a store, copy or put reported written, into any tier)
forgets it; the fresh copy is then found first, and once it is evicted an unreadable older copy
below may be offered once more (and, failing again, remembered again).

What stays where: a block that failed verification is also quarantined by its tier (out of the
index); a block that could not be read keeps its index entry and its bytes (I/O errors keep the
data where it was: the error may pass, and a restart or `fsck` reads it again): it is only not
offered while remembered. The copies in other tiers are untouched.

Bounded: at most `cap` keys, least recently failed forgotten first (counted in
`failed_loads_forgotten`); a forgotten block may be offered once more and, when it fails again,
is remembered again. The memory is per process: after a restart such a block is offered once.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Sequence

DEFAULT_CAP = 1 << 16   # keys (~10 MiB at most)


class FailedLoads:
    """A capped LRU set of keys whose load failed."""

    def __init__(self, cap: int = DEFAULT_CAP) -> None:
        if cap < 1:
            raise ValueError(f"failed-load memory needs room for one key, got cap={cap}")
        self.cap = cap
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: bytes) -> bool:
        return key in self._keys

    def add(self, keys: Iterable[bytes]) -> tuple[int, int]:
        """Remember `keys`: (how many were new, how many older keys the cap made forget)."""
        new = forgotten = 0
        for k in keys:
            if k in self._keys:
                self._keys.move_to_end(k)
                continue
            self._keys[k] = None
            new += 1
            if len(self._keys) > self.cap:
                self._keys.popitem(last=False)
                forgotten += 1
        return new, forgotten

    def forget(self, keys: Iterable[bytes]) -> int:
        """A fresh copy of these keys was written: offered again. Returns how many were remembered."""
        if not self._keys:
            return 0
        n = 0
        for k in keys:
            if self._keys.pop(k, 0) is None:
                n += 1
        return n

    def clean(self, keys: Sequence[bytes], n: int | None = None) -> int:
        """Length of the prefix of `keys[:n]` with no remembered key."""
        n = len(keys) if n is None else n
        if self._keys:
            for i in range(n):
                if keys[i] in self._keys:
                    return i
        return n
