"""A keyed payload checksum that torch computes on any device: the same function on host and GPU
tensors, so a block written from host memory is verified in device memory (and the reverse).

Per 8-byte little-endian word w_i (the payload zero-padded to a multiple of 8 bytes):
    x = (w_i XOR k_i) * C1;  x ^= x >> 32;  x *= C2;  x ^= x >> 29;  sum = SUM x   (mod 2**64)
with the per-position keys k_i and the odd multipliers C1, C2 derived from a 64-bit seed (the
directory's secret: `nvme_block.BlockCodec`). Each word goes through a keyed bijective mixer
that depends on its position, so a flipped bit, a changed word or two swapped words change the
sum (a random change collides with probability about 2**-64). Vectorised: a few elementwise
int64 kernels and one reduction (wrapping arithmetic, the same on CPU and CUDA).

Not cryptographic by itself: it is what the header records about the payload, and the header's
BLAKE2b tag (keyed with the secret) binds it with the key, length and fingerprint, so a block
planted without the secret still fails the tag. Like the xxh3 it replaces on this format, it
detects corruption; it does not stop someone who can read the secret or many (payload, sum)
pairs from crafting a colliding payload.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

MASK = (1 << 64) - 1


def _splitmix(x: np.ndarray) -> np.ndarray:
    """splitmix64 of each uint64 (wrapping)."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _signed(v: int) -> int:
    v &= MASK
    return v - (1 << 64) if v >> 63 else v


def _lsr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


class KeyedSum:
    """`sum(t)`: the keyed checksum of the bytes of a contiguous tensor, on the tensor's device.
    The per-position keys are made once per (device, words) and kept."""

    def __init__(self, seed: int) -> None:
        self.seed = seed & MASK
        c = _splitmix(np.array([self.seed ^ 1, self.seed ^ 2], dtype=np.uint64))
        self.c1, self.c2 = (_signed(int(v) | 1) for v in c)
        self._keys: dict[tuple[str, int], torch.Tensor] = {}
        self._lock = threading.Lock()

    def keys(self, device: torch.device, words: int) -> torch.Tensor:
        k = (str(device), words)
        t = self._keys.get(k)
        if t is None:
            with self._lock:
                t = self._keys.get(k)
                if t is None:
                    base = np.arange(words, dtype=np.uint64) + np.uint64(self.seed)
                    t = torch.from_numpy(_splitmix(base).view(np.int64)).to(device)
                    self._keys[k] = t
        return t

    def __call__(self, t: torch.Tensor) -> int:
        b = t.reshape(-1)
        if b.dtype != torch.uint8:
            b = b.view(torch.uint8)
        n = b.numel()
        words = (n + 7) // 8
        if n % 8 or b.storage_offset() % 8:  # padded / aligned on the same device: no host copy
            w = torch.zeros(words * 8, dtype=torch.uint8, device=b.device)
            w[:n].copy_(b)
            b = w
        x = b.view(torch.int64) ^ self.keys(b.device, words)
        x.mul_(self.c1)
        x ^= _lsr(x, 32)
        x.mul_(self.c2)
        x ^= _lsr(x, 29)
        return int(x.sum().item()) & MASK
