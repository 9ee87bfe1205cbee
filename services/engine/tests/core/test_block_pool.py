"""BlockPool and FreeBlockQueue on a ten-block pool: exact ids, ref counts and queue order."""

from __future__ import annotations

import pytest

from conveyor.engine.core.block_hash import BlockKey, block_key, hash_block_tokens
from conveyor.engine.core.block_pool import BlockPool
from conveyor.engine.core.free_block_queue import FreeBlockQueue
from conveyor.engine.core.kv_block import KVCacheBlock


def cache(pool: BlockPool, block: KVCacheBlock, tokens: tuple[int, ...]) -> bytes:
    key = BlockKey(None, tokens)
    block_hash = hash_block_tokens(key)
    assert pool.cache_block(block, block_hash, key)
    return block_hash


def test_free_queue_pop_append_and_remove_from_the_middle():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert queue.block_ids() == [0, 1, 3, 4]
    assert queue.popleft() is blocks[0]
    queue.append(blocks[2])
    queue.append(blocks[0])
    assert queue.block_ids() == [1, 3, 4, 2, 0]
    assert blocks[3] in queue and blocks[0] in queue and len(queue) == 5


def test_free_queue_pop_from_empty_raises():
    with pytest.raises(IndexError):
        FreeBlockQueue().popleft()


def test_allocate_takes_blocks_from_the_head_with_one_reference():
    pool = BlockPool(10)
    blocks = pool.allocate(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.free_queue.block_ids() == [3, 4, 5, 6, 7, 8, 9]
    assert (pool.num_free_blocks, pool.num_used_blocks, pool.usage) == (7, 3, 0.3)


def test_allocate_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(10)
    pool.allocate(8)
    with pytest.raises(ValueError):
        pool.allocate(3)
    assert pool.num_free_blocks == 2


def test_free_appends_in_the_order_given_and_touch_unqueues():
    pool = BlockPool(10)
    first, second = pool.allocate(3), pool.allocate(2)  # 0 1 2 | 3 4
    pool.free(reversed(first))  # tail first
    assert pool.free_queue.block_ids() == [5, 6, 7, 8, 9, 2, 1, 0]
    pool.touch([first[1]])  # a prefix hit takes block 1 back from the middle
    assert first[1].ref_cnt == 1
    assert pool.free_queue.block_ids() == [5, 6, 7, 8, 9, 2, 0]
    pool.touch([second[0]])  # a second holder of block 3
    pool.free([second[0]])
    assert second[0].ref_cnt == 1 and 3 not in pool.free_queue.block_ids()


def test_cached_block_keeps_its_hash_while_free_and_loses_it_when_reused():
    pool = BlockPool(2)
    block = pool.allocate(1)[0]
    block_hash = cache(pool, block, (1, 2, 3, 4))
    pool.free([block])
    assert block.is_free and pool.cached_blocks[block_hash] is block
    assert pool.get_cached_block(block_hash, BlockKey(None, (1, 2, 3, 4))) is block
    assert pool.free_queue.block_ids() == [1, 0]
    pool.allocate(1)  # block 1, uncached: no eviction
    assert pool.num_evictions == 0
    reused = pool.allocate(1)[0]
    assert reused is block and block.block_hash is None and block.key is None
    assert pool.cached_blocks == {} and pool.num_evictions == 1


def test_get_cached_block_confirms_the_stored_key():
    pool = BlockPool(4)
    block = pool.allocate(1)[0]
    block_hash = cache(pool, block, (1, 2, 3, 4))
    assert pool.get_cached_block(block_hash, BlockKey(None, (1, 2, 3, 5))) is None
    assert pool.get_cached_block(block_hash, BlockKey(None, (1, 2, 3, 4), ("salt",))) is None
    assert pool.get_cached_block(b"unknown", BlockKey(None, (1, 2, 3, 4))) is None


def test_a_second_block_with_the_same_hash_stays_private():
    pool = BlockPool(4)
    first, second = pool.allocate(2)
    block_hash = cache(pool, first, (7, 7, 7, 7))
    assert not pool.cache_block(second, block_hash, BlockKey(None, (7, 7, 7, 7)))
    assert second.block_hash is None and pool.cached_blocks[block_hash] is first


def test_hash_chains_parent_tokens_and_salt():
    root = hash_block_tokens(block_key([1, 2, 3, 4], None, None))
    assert root == hash_block_tokens(block_key((1, 2, 3, 4), None, None))
    assert root != hash_block_tokens(block_key([1, 2, 3, 5], None, None))
    assert root != hash_block_tokens(block_key([1, 2, 3, 4], None, "tenant-a"))
    child = hash_block_tokens(block_key([5, 6, 7, 8], root, "tenant-a"))
    assert block_key([5, 6, 7, 8], root, "tenant-a").extra_keys == ()  # salt: first block only
    assert child != hash_block_tokens(block_key([5, 6, 7, 8], None, None))
    assert len(root) == 32


def test_the_lora_adapter_keys_the_first_block_apart_from_the_salt():
    def first(salt, lora):
        return hash_block_tokens(block_key([1, 2, 3, 4], None, salt, lora))

    assert first(None, "adapter") not in {first(None, None), first("adapter", None),
                                          first(None, "other")}
    assert first("tenant", "adapter") != first("tenant", None)
    assert block_key([5, 6], b"parent", "tenant", "adapter").extra_keys == ()


def test_pool_needs_a_block():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)
