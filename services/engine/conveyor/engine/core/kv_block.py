"""One fixed-size block of KV slots: its id, reference count and prefix-cache identity."""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.engine.core.block_hash import BlockHash, BlockKey


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """Block `block_id` holds the KV of slots `block_id * block_size ..` `+ block_size - 1`.

    Invariants (kept by BlockPool): `ref_cnt` is the number of block tables that
    hold the block; the block is in the free queue exactly when `ref_cnt == 0`;
    `block_hash is not None` exactly when the pool's hash map sends that hash to
    this block, and then `key` is what the hash was computed from. A free block
    keeps its hash (a later request may still hit it) until it is popped for reuse.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    key: BlockKey | None = None

    @property
    def is_cached(self) -> bool:
        return self.block_hash is not None

    @property
    def is_free(self) -> bool:
        return self.ref_cnt == 0
