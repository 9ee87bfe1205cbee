"""Hashes of a prompt's leading full blocks, for prefix-cache hints.

Chained like the engine's block hashes: block i's hash covers the cache salt
and every token up to the end of block i, so equal hashes mean equal prefixes
(within one salt: tenants with different salts never share cached blocks, so
they never share hints either). Only full blocks count, as only full blocks
are cached.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def prefix_block_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int,
                        cache_salt: str = "") -> list[str]:
    """Hex hashes of the first min(max_blocks, len // block_size) block prefixes,
    shortest prefix first."""
    num_blocks = min(max_blocks, len(token_ids) // block_size)
    hashes: list[str] = []
    parent = hashlib.blake2b(cache_salt.encode(), digest_size=16).digest()
    for i in range(num_blocks):
        block = array("q", token_ids[i * block_size:(i + 1) * block_size]).tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        hashes.append(parent.hex())
    return hashes
