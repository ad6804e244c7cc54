"""Block keys: the 16-byte ids under which hiqcached stores KV blocks (docs/design.md "Keys").

The chain of the C++ client (block_keys.h), byte for byte:
  key_{-1} = XXH3_128(salt)
  key_i    = XXH3_128(key_{i-1} || tokens of block i as little-endian uint32)
each key in XXH3's canonical (big-endian) form. A key names the whole prefix up to and including
its block; only full blocks get keys. The salt separates key spaces that must not share blocks
(model identity, LoRA adapter, multimodal inputs). Pure functions; the same in every process
(no PYTHONHASHSEED involved).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

BlockKey = bytes  # exactly 16 bytes


def root_block_key(salt: bytes | str = b"") -> BlockKey:
    if isinstance(salt, str):
        salt = salt.encode()
    return xxhash.xxh3_128_digest(salt)


def chain_block_key(previous: BlockKey, tokens: Sequence[int] | np.ndarray) -> BlockKey:
    data = np.asarray(tokens, dtype=np.int64).astype("<u4", casting="unsafe").tobytes()
    return xxhash.xxh3_128_digest(previous + data)


def compute_block_keys(tokens: Sequence[int] | np.ndarray, block_tokens: int,
                       salt: bytes | str = b"", max_blocks: int | None = None) -> list[BlockKey]:
    """Keys of the floor(len(tokens) / block_tokens) full blocks (at most max_blocks)."""
    if block_tokens <= 0:
        return []
    arr = np.asarray(tokens, dtype=np.int64).astype("<u4", casting="unsafe")
    n = len(arr) // block_tokens
    if max_blocks is not None:
        n = min(n, max_blocks)
    data = arr[: n * block_tokens].tobytes()
    step = block_tokens * 4
    key = root_block_key(salt)
    keys = []
    for i in range(n):
        key = xxhash.xxh3_128_digest(key + data[i * step:(i + 1) * step])
        keys.append(key)
    return keys
