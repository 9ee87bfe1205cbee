"""The pool of KV blocks: reference counts, the free queue and the prefix-cache hash map."""

from __future__ import annotations

from collections.abc import Iterable

from conveyor.engine.core.block_hash import BlockHash, BlockKey
from conveyor.engine.core.free_block_queue import FreeBlockQueue
from conveyor.engine.core.kv_block import KVCacheBlock


class BlockPool:
    """`num_blocks` blocks, each either free (in the free queue) or held by block tables.

    Invariants: `num_free_blocks + num_used_blocks == num_blocks`; a block is in
    the free queue exactly when its ref count is 0; `cached_blocks[h]` is the one
    block whose `block_hash` is h. Freed blocks stay in `cached_blocks` until
    `allocate` pops them for reuse, which counts as an eviction.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}
        self.num_evictions = 0
        """Cached blocks whose contents were dropped because the block was reused."""

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, 0.0 .. 1.0 (free cached blocks count as free)."""
        return self.num_used_blocks / len(self.blocks)

    def allocate(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop `num_blocks` blocks from the head of the free queue, each with ref count 1.

        A popped block that was cached loses its hash here. Raises ValueError if
        fewer blocks are free (callers check `num_free_blocks` first).
        """
        if num_blocks > len(self.free_queue):
            raise ValueError(f"asked for {num_blocks} blocks, {len(self.free_queue)} free")
        blocks = [self.free_queue.popleft() for _ in range(num_blocks)]
        for block in blocks:
            self._evict(block)
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference to each block (prefix-cache hits), unqueueing free ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; those reaching 0 join the free queue in the
        order given, so pass a request's blocks tail first to have its tail evicted first."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def get_cached_block(self, block_hash: BlockHash, key: BlockKey) -> KVCacheBlock | None:
        """The cached block with this hash, if its stored key equals `key` (a hash collision
        with different tokens, parent or salt is a miss)."""
        block = self.cached_blocks.get(block_hash)
        if block is None or block.key != key:
            return None
        return block

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash, key: BlockKey) -> bool:
        """Enter a newly full block in the hash map; False (block stays private) when another
        block already holds that hash."""
        if block.block_hash is not None or block_hash in self.cached_blocks:
            return False
        block.block_hash = block_hash
        block.key = key
        self.cached_blocks[block_hash] = block
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        del self.cached_blocks[block.block_hash]
        block.block_hash = None
        block.key = None
        self.num_evictions += 1
