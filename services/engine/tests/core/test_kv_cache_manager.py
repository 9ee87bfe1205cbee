"""KVCacheManager on a tiny pool (10 blocks of 4 tokens): tables, prefix hits, eviction order."""

from __future__ import annotations

import pytest

from conveyor.engine.core import block_hash
from conveyor.engine.core.kv_cache_manager import KVCacheManager
from conveyor.engine.core.request import Request


def req(request_id: str, prompt: list[int], cache_salt: str | None = None) -> Request:
    return Request(request_id, list(prompt), cache_salt=cache_salt)


def compute(kv: KVCacheManager, request: Request, num_tokens: int) -> list[int]:
    """Allocate and "run" num_tokens of the request, as a scheduler step would; the new ids."""
    new_blocks = kv.allocate_slots(request, num_tokens)
    assert new_blocks is not None
    request.num_computed_tokens += num_tokens
    kv.cache_computed_blocks(request)
    return [block.block_id for block in new_blocks]


def admit(kv: KVCacheManager, request: Request) -> int:
    """Admit with prefix hits and compute the rest of the prompt; the number of hit tokens."""
    hits, num_hit_tokens = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_hit_tokens, hits) is not None
    request.num_computed_tokens = request.num_tokens
    kv.cache_computed_blocks(request)
    return num_hit_tokens


def ref_counts(kv: KVCacheManager) -> list[int]:
    return [block.ref_cnt for block in kv.pool.blocks]


PROMPT = list(range(100, 110))  # 10 tokens: blocks [100..103] [104..107] [108 109 _ _]


def test_allocation_and_growth_one_block_at_a_time():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = req("a", PROMPT)
    assert compute(kv, a, 10) == [0, 1, 2]
    for token, expected_new in [(1, []), (2, []), (3, [3]), (4, []), (5, []), (6, []), (7, [4])]:
        a.output_token_ids.append(token)
        assert compute(kv, a, 1) == expected_new
    assert kv.block_table(a) == [0, 1, 2, 3, 4]
    assert ref_counts(kv) == [1] * 5 + [0] * 5
    assert kv.pool.free_queue.block_ids() == [5, 6, 7, 8, 9]
    assert kv.usage == 0.5


def test_free_returns_the_tail_block_first():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = req("a", PROMPT)
    compute(kv, a, 10)
    kv.free(a)
    assert kv.block_table(a) == []
    assert ref_counts(kv) == [0] * 10
    assert kv.pool.free_queue.block_ids() == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    kv.free(a)  # no-op
    assert kv.num_free_blocks == 10


def test_reuse_evicts_least_recently_used_and_tail_blocks_first():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = req("a", PROMPT)
    compute(kv, a, 10)  # blocks 0, 1 cached (full); block 2 partial
    kv.free(a)
    b = req("b", list(range(200, 228)))  # 28 tokens: 7 blocks, all the never-used ones first
    assert compute(kv, b, 28) == [3, 4, 5, 6, 7, 8, 9]
    assert kv.pool.num_evictions == 0
    c = req("c", list(range(300, 306)))  # 2 blocks: a's tail (2, uncached), then block 1
    assert compute(kv, c, 6) == [2, 1]
    assert kv.pool.num_evictions == 1
    assert kv.pool.free_queue.block_ids() == [0]
    a_again = req("a2", PROMPT)
    hits, num_hit_tokens = kv.get_computed_blocks(a_again)
    assert [block.block_id for block in hits] == [0] and num_hit_tokens == 4


def test_allocate_slots_returns_none_when_the_pool_cannot_and_changes_nothing():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    compute(kv, req("a", list(range(32))), 32)  # 8 blocks
    b = req("b", list(range(500, 512)))  # needs 3, 2 free
    assert kv.allocate_slots(b, 12) is None
    assert kv.block_table(b) == [] and kv.num_free_blocks == 2
    assert kv.allocate_slots(b, 8) is not None  # a first chunk fits


def test_prefix_hit_across_requests_shares_full_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = req("a", PROMPT)
    assert admit(kv, a) == 0
    b = req("b", PROMPT[:8] + [1, 2, 3, 4, 5])
    assert admit(kv, b) == 8
    assert kv.block_table(a) == [0, 1, 2]
    assert kv.block_table(b) == [0, 1, 3, 4]
    assert ref_counts(kv)[:5] == [2, 2, 1, 1, 1]
    kv.free(a)
    assert ref_counts(kv)[:5] == [1, 1, 0, 1, 1]
    assert kv.pool.free_queue.block_ids() == [5, 6, 7, 8, 9, 2]
    assert (kv.num_prefix_query_tokens, kv.num_prefix_hit_tokens) == (23, 8)


def test_hit_on_free_cached_blocks_takes_them_out_of_the_free_queue():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = req("a", PROMPT)
    admit(kv, a)
    kv.free(a)
    b = req("b", PROMPT[:9])  # ends mid-block: 2 full blocks hit, 1 token to compute
    assert admit(kv, b) == 8
    assert kv.block_table(b) == [0, 1, 3]
    assert ref_counts(kv)[:4] == [1, 1, 0, 1]
    assert kv.pool.free_queue.block_ids() == [4, 5, 6, 7, 8, 9, 2]


def test_the_last_prompt_token_is_never_served_from_the_cache():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    admit(kv, req("a", PROMPT))
    hits, num_hit_tokens = kv.get_computed_blocks(req("b", PROMPT[:8]))  # 2 full blocks
    assert [block.block_id for block in hits] == [0] and num_hit_tokens == 4
    hits, num_hit_tokens = kv.get_computed_blocks(req("c", PROMPT[:4]))
    assert hits == [] and num_hit_tokens == 0


def test_a_prompt_that_diverges_mid_chain_hits_only_the_common_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    admit(kv, req("a", PROMPT))
    b = req("b", PROMPT[:4] + [0, 0, 0, 0] + PROMPT[8:])
    assert admit(kv, b) == 4
    c = req("c", [0] + PROMPT[1:])  # first block differs: later blocks' hashes differ too
    assert admit(kv, c) == 0


def test_forced_hash_collision_is_rejected_by_the_token_comparison(monkeypatch):
    monkeypatch.setattr(block_hash, "hash_block_tokens", lambda key: b"\x00" * 32)
    kv = KVCacheManager(num_blocks=10, block_size=4)
    admit(kv, req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert list(kv.pool.cached_blocks.values()) == [kv.pool.blocks[0]]  # one hash, one entry
    b = req("b", [9, 9, 9, 9, 5, 6, 7, 8, 9])  # same hash for every block, other tokens
    hits, num_hit_tokens = kv.get_computed_blocks(b)
    assert hits == [] and num_hit_tokens == 0
    assert kv.get_computed_blocks(req("c", [1, 2, 3, 4, 0]))[1] == 4  # a true hit still hits


def test_cache_salt_isolates_tenants():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    admit(kv, req("a", PROMPT, cache_salt="tenant-1"))
    assert kv.get_computed_blocks(req("b", PROMPT, cache_salt="tenant-2"))[1] == 0
    assert kv.get_computed_blocks(req("c", PROMPT))[1] == 0
    assert kv.get_computed_blocks(req("d", PROMPT, cache_salt="tenant-1"))[1] == 8


def test_salted_collision_is_rejected_too(monkeypatch):
    monkeypatch.setattr(block_hash, "hash_block_tokens", lambda key: b"\x00" * 32)
    kv = KVCacheManager(num_blocks=10, block_size=4)
    admit(kv, req("a", PROMPT, cache_salt="tenant-1"))
    assert kv.get_computed_blocks(req("b", PROMPT, cache_salt="tenant-2"))[1] == 0


def test_blocks_filled_by_decode_tokens_are_cached():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = req("a", PROMPT[:6])
    compute(kv, a, 6)
    assert len(kv.pool.cached_blocks) == 1
    for token in (1, 2):  # each decode step computes the previous step's sampled token
        a.output_token_ids.append(token)
        compute(kv, a, 1)
    assert len(kv.pool.cached_blocks) == 2 and kv.pool.blocks[1].is_cached
    assert kv.pool.blocks[1].key.token_ids == (104, 105, 1, 2)
    b = req("b", PROMPT[:6] + [1, 2, 77])
    assert kv.get_computed_blocks(b)[1] == 8


def test_only_computed_blocks_are_cached():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = req("a", PROMPT)
    compute(kv, a, 3)  # a first chunk of 3 tokens: no full block computed yet
    assert kv.pool.cached_blocks == {}
    compute(kv, a, 5)
    assert [b.block_id for b in kv.pool.blocks if b.is_cached] == [0, 1]


def test_prefix_caching_disabled():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    admit(kv, req("a", PROMPT))
    assert kv.pool.cached_blocks == {}
    assert kv.get_computed_blocks(req("b", PROMPT)) == ([], 0)
    assert kv.num_prefix_query_tokens == 0


def test_slot_mapping_follows_the_block_table():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    compute(kv, req("x", list(range(8))), 8)  # blocks 0, 1
    a = req("a", PROMPT)
    compute(kv, a, 4)  # block 2
    compute(kv, req("y", list(range(4))), 4)  # block 3
    compute(kv, a, 6)  # blocks 4, 5
    assert kv.block_table(a) == [2, 4, 5]
    assert kv.slot_mapping(a, 3, 9) == [11, 16, 17, 18, 19, 20]
    table = kv.block_table(a)
    assert kv.slot_mapping(a, 0, 10) == [table[t // 4] * 4 + t % 4 for t in range(10)]


def test_num_reclaimable_blocks_counts_unshared_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a, b = req("a", PROMPT), req("b", PROMPT[:8] + [1, 2, 3])
    admit(kv, a)
    admit(kv, b)
    assert kv.num_reclaimable_blocks(a) == 1  # blocks 0, 1 are shared with b
    assert kv.num_reclaimable_blocks(b, keep=[kv.pool.blocks[3]]) == 0


@pytest.mark.parametrize("prompt_lens", [(300, 1100, 600)])
def test_worked_example_paged_vs_contiguous(prompt_lens):
    """The seeds' example: 2,000 tokens in 16-token blocks hold 2,016 slots; reserving
    max_len 2,048 contiguously per request would hold 6,144."""
    kv = KVCacheManager(num_blocks=200, block_size=16, enable_prefix_caching=False)
    requests = [req(f"r{i}", list(range(n))) for i, n in enumerate(prompt_lens)]
    for request, n in zip(requests, prompt_lens, strict=True):
        compute(kv, request, n)
    tables = [kv.block_table(request) for request in requests]
    assert [len(t) for t in tables] == [19, 69, 38]
    slots = sum(len(t) for t in tables) * 16
    assert (sum(prompt_lens), slots, 3 * 2048) == (2000, 2016, 6144)
    assert all(len(t) * 16 - n < 16 for t, n in zip(tables, prompt_lens, strict=True))
    assert kv.pool.num_used_blocks == 126
