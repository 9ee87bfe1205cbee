"""Block tables over the block pool, with prefix-cache lookups and caching. Each request
owns its table (`Request.block_ids`); the manager allocates, caches and frees its blocks."""

from __future__ import annotations

from collections.abc import Sequence

from conveyor.engine.core import block_hash
from conveyor.engine.core.block_hash import BlockKey
from conveyor.engine.core.block_pool import BlockPool
from conveyor.engine.core.kv_block import KVCacheBlock
from conveyor.engine.core.request import Request


class KVCacheManager:
    """Which blocks hold each request's KV, and which full blocks other requests may share.

    A request's block table (`request.block_ids`, None while it holds no blocks) lists
    block ids in position order: position p lives in slot `table[p // block_size] *
    block_size + p % block_size`. Invariants: a table covers at least the request's
    `num_computed_tokens`; every block in a table holds one reference per table that lists
    it; only full blocks whose KV has been computed are entered in the prefix cache
    (`cache_computed_blocks`; `request.num_cached_blocks` of its table are).
    """

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True):
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_prefix_query_tokens = 0
        """Tokens of admitted requests looked up in the prefix cache."""
        self.num_prefix_hit_tokens = 0
        """Of those, tokens found cached (their prefill was skipped)."""

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_prefix_hit_tokens / max(self.num_prefix_query_tokens, 1)

    @staticmethod
    def block_table(request: Request) -> list[int]:
        """The request's block ids (the live list: it grows as the request does); [] if none."""
        return request.block_ids if request.block_ids is not None else []

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request in full blocks, and its length in tokens.

        Never covers the last token: at least one token is computed so the step
        has logits to sample from. Each hit is confirmed against the block's
        stored key; the first miss ends the prefix. Takes no references. A request
        that asked for prompt logprobs gets no hit (a cached position has no logits;
        vLLM does the same); its blocks are still cached for others.
        """
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        num_blocks = (request.num_tokens - 1) // self.block_size
        self._extend_block_hashes(request, num_blocks)
        hits: list[KVCacheBlock] = []
        for index in range(num_blocks):
            key = self._block_key(request, index)
            block = self.pool.get_cached_block(request.block_hashes[index], key)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def num_blocks_to_allocate(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[KVCacheBlock] = ()
    ) -> int:
        """Free blocks that `allocate_slots` with these arguments would take from the pool."""
        num_free_hits = sum(1 for block in computed_blocks if block.ref_cnt == 0)
        return self._num_new_blocks(request, num_new_tokens, computed_blocks) + num_free_hits

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[KVCacheBlock] = ()
    ) -> list[KVCacheBlock] | None:
        """Grow the request's table to hold `num_new_tokens` more tokens; None if the pool
        cannot (nothing changes then).

        `computed_blocks` (from `get_computed_blocks`) is only for a request that
        holds no blocks yet: they start its table and count as computed. Returns
        the newly allocated blocks, possibly [] (test the result with `is None`).
        """
        num_new_blocks = self._num_new_blocks(request, num_new_tokens, computed_blocks)
        num_free_hits = sum(1 for block in computed_blocks if block.ref_cnt == 0)
        if num_new_blocks + num_free_hits > self.pool.num_free_blocks:
            return None
        table = request.block_ids
        if table is None:
            table = self._start_table(request, computed_blocks)
        if num_new_blocks == 0:
            return []
        new_blocks = self.pool.allocate(num_new_blocks)
        table.extend(block.block_id for block in new_blocks)
        return new_blocks

    def cache_computed_blocks(self, request: Request) -> None:
        """Enter the request's blocks that are full of computed KV into the prefix cache
        (prompt blocks and blocks filled by decode tokens alike). Call after each step."""
        if not self.enable_prefix_caching:
            return
        first = request.num_cached_blocks
        last = request.num_computed_tokens // self.block_size
        if last <= first:
            return
        self._extend_block_hashes(request, last)
        table = request.block_ids
        for index in range(first, last):
            key = self._block_key(request, index)
            self.pool.cache_block(self.pool.blocks[table[index]], request.block_hashes[index], key)
        request.num_cached_blocks = last

    def free(self, request: Request) -> None:
        """Return the request's blocks to the pool, tail block first (evicted first).
        A no-op for a request that holds none."""
        table, request.block_ids, request.num_cached_blocks = request.block_ids, None, 0
        if table is not None:
            self.pool.free(self.pool.blocks[block_id] for block_id in reversed(table))

    def free_tail(self, request: Request, num_tokens: int) -> None:
        """Return the request's blocks past those its first `num_tokens` positions need
        (they hold only rejected drafts' KV, never cached), last block first."""
        table = request.block_ids
        keep = -(-num_tokens // self.block_size)
        if len(table) > keep:
            self.pool.free(self.pool.blocks[block_id] for block_id in reversed(table[keep:]))
            del table[keep:]

    def num_reclaimable_blocks(self, request: Request, keep: Sequence[KVCacheBlock] = ()) -> int:
        """Blocks that `free(request)` would return to the free queue, not counting `keep`
        (blocks shared with other tables stay in use)."""
        kept = {block.block_id for block in keep}
        blocks = self.pool.blocks
        table = request.block_ids or ()
        return sum(1 for i in table if blocks[i].ref_cnt == 1 and i not in kept)

    def slot_mapping(self, request: Request, start: int, end: int) -> list[int]:
        """KV slots of positions start .. end - 1, built one block-sized run at a time."""
        table = request.block_ids
        size = self.block_size
        slots: list[int] = []
        position = start
        while position < end:
            index, offset = divmod(position, size)
            run = min(end - position, size - offset)
            base = table[index] * size + offset
            slots.extend(range(base, base + run))
            position += run
        return slots

    def _num_new_blocks(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_needed = -(-(num_computed + num_new_tokens) // self.block_size)
        num_held = len(request.block_ids or ()) + len(computed_blocks)
        return max(num_needed - num_held, 0)

    def _start_table(self, request: Request, computed_blocks: Sequence[KVCacheBlock]) -> list[int]:
        self.pool.touch(computed_blocks)
        table = [block.block_id for block in computed_blocks]
        request.block_ids, request.num_cached_blocks = table, len(computed_blocks)
        if self.enable_prefix_caching:
            self.num_prefix_query_tokens += request.num_tokens
            self.num_prefix_hit_tokens += len(computed_blocks) * self.block_size
        return table

    def _extend_block_hashes(self, request: Request, num_blocks: int) -> None:
        hashes = request.block_hashes
        for index in range(len(hashes), num_blocks):
            hashes.append(block_hash.hash_block_tokens(self._block_key(request, index)))

    def _block_key(self, request: Request, index: int) -> BlockKey:
        start = index * self.block_size
        parent = request.block_hashes[index - 1] if index > 0 else None
        tokens = request.token_ids_in(start, start + self.block_size)
        lora_key = request.lora.key if request.lora is not None else None
        return block_hash.block_key(tokens, parent, request.cache_salt, lora_key)
