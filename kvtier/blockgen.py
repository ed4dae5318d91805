"""Deterministic pseudo-random block contents: block i of seed s is always the same bytes."""

from __future__ import annotations

import numpy as np
import torch

from .keys import make_key


def block_key(seed: int, index: int) -> bytes:
    """Key of synthetic block `index` (a chain of one: spill/restore blocks are independent)."""
    return make_key(((seed & 0xFFFFFFFF) << 32) | (index & 0xFFFFFFFF))


def block_data(seed: int, index: int, block_bytes: int) -> torch.Tensor:
    """`block_bytes` pseudo-random bytes determined by (seed, index)."""
    rng = np.random.Generator(np.random.PCG64([seed & 0xFFFFFFFF, index]))
    return torch.from_numpy(np.frombuffer(bytearray(rng.bytes(block_bytes)), dtype=np.uint8))


def fill_block(out: torch.Tensor, seed: int, index: int) -> None:
    """Write block (seed, index) into `out` (uint8, block_bytes) in place."""
    n = out.numel()
    rng = np.random.Generator(np.random.PCG64([seed & 0xFFFFFFFF, index]))
    out.copy_(torch.from_numpy(np.frombuffer(bytearray(rng.bytes(n)), dtype=np.uint8)))
