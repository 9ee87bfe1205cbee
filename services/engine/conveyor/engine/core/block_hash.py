"""Prefix-cache hashes: a full block's hash chains its parent's hash, its tokens and extra keys.

sha256 over a fixed byte encoding, not Python's `hash()`: it is the same in every
process and run (Python salts `hash(str)` per process, and the cache salt is a
string), and a 256-bit digest makes an accidental collision between tenants' blocks
practically impossible. Only the engine computes these: the gateway's prefix routing
hints are hashes of its own (routing/policy.py:prefix_block_hashes, blake2b over its
own encoding), which name prefixes but never match these. The prefix cache never
trusts the hash alone: a hit is confirmed against the block's stored `BlockKey`
(parent hash, token ids, extra keys).
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

BlockHash = bytes
"""A sha256 digest (32 bytes)."""


@dataclass(frozen=True, slots=True)
class BlockKey:
    """Everything a block hash is computed from; cached blocks keep it to confirm hits."""

    parent_hash: BlockHash | None
    """The previous block's hash; None for a sequence's first block."""
    token_ids: tuple[int, ...]
    extra_keys: tuple[str, ...] = ()
    """Keys that must also match: the tenant's cache salt and the LoRA adapter (first block
    only: later blocks inherit them through `parent_hash`)."""


def hash_block_tokens(key: BlockKey) -> BlockHash:
    """sha256 of a length-prefixed encoding of `key` (distinct keys never share an encoding)."""
    digest = hashlib.sha256()
    parent = key.parent_hash
    digest.update(b"\x00" if parent is None else b"\x01" + parent)
    digest.update(struct.pack("<I", len(key.token_ids)))
    digest.update(array("q", key.token_ids).tobytes())
    for extra in key.extra_keys:
        encoded = extra.encode()
        digest.update(struct.pack("<I", len(encoded)) + encoded)
    return digest.digest()


def block_key(
    token_ids: Sequence[int],
    parent_hash: BlockHash | None,
    cache_salt: str | None,
    lora_key: str | None = None,
) -> BlockKey:
    """The key of a block whose parent hash is `parent_hash` (None: the first block). The
    first block's extra keys name the cache salt and the LoRA adapter, each tagged so that
    a salt never reads as an adapter."""
    extra_keys: tuple[str, ...] = ()
    if parent_hash is None:
        extra_keys = tuple(f"{tag}={value}" for tag, value in
                           (("salt", cache_salt), ("lora", lora_key)) if value is not None)
    return BlockKey(parent_hash, tuple(token_ids), extra_keys)
