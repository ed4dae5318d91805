"""Deterministic pseudo-random block contents: block i of seed s is always the same bytes."""

from __future__ import annotations

import numpy as np
import torch

from kvtier.core.keys import GROUP_ID_BYTES, make_key


SPILL_PREFIX = b"kvtier-spill\0"


def block_key(seed: int, index: int) -> bytes:
    """Key of synthetic block `index` of `seed` (a chain of one: spill/restore blocks are
    independent). Its hash part is a 13-byte prefix + 8-byte seed + 8-byte index: 29 bytes, a
    length no vLLM block hash (32 bytes) nor replay hash id (8 bytes) has, so they never collide."""
    return make_key(SPILL_PREFIX + seed.to_bytes(8, "big") + index.to_bytes(8, "big"))


def split_block_key(key: bytes) -> tuple[int, int] | None:
    """(seed, index) of a `block_key`, or None for any other key."""
    n = len(SPILL_PREFIX)
    if len(key) != n + 16 + GROUP_ID_BYTES or not key.startswith(SPILL_PREFIX):
        return None
    return int.from_bytes(key[n:n + 8], "big"), int.from_bytes(key[n + 8:n + 16], "big")


def block_data(seed: int, index: int, block_bytes: int) -> torch.Tensor:
    """`block_bytes` pseudo-random bytes determined by (seed, index)."""
    rng = np.random.Generator(np.random.PCG64([seed, index]))
    return torch.from_numpy(np.frombuffer(bytearray(rng.bytes(block_bytes)), dtype=np.uint8))


def fill_block(out: torch.Tensor, seed: int, index: int) -> None:
    """Write block (seed, index) into `out` (uint8, block_bytes) in place."""
    n = out.numel()
    rng = np.random.Generator(np.random.PCG64([seed, index]))
    out.copy_(torch.from_numpy(np.frombuffer(bytearray(rng.bytes(n)), dtype=np.uint8)))
