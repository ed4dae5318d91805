"""Block keys: opaque bytes, vLLM's chained block hash plus a 4-byte KV-cache group id."""

from __future__ import annotations

GROUP_ID_BYTES = 4


def make_key(block_hash: bytes | int, group_id: int = 0) -> bytes:
    """Key of one block: its chained hash then the group id (vLLM's BlockHashWithGroupId encoding)."""
    if isinstance(block_hash, int):
        block_hash = block_hash.to_bytes(8, "big", signed=False)
    return bytes(block_hash) + group_id.to_bytes(GROUP_ID_BYTES, "big", signed=False)
