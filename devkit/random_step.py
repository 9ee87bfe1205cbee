"""Random paged-attention steps, for checking one attention backend against another.

Used by the engine's tests (Triton against torch, on a GPU too) and by bench/gpu.py:
a step is a set of requests with some tokens already in a pool whose blocks are handed
out in shuffled order, plus random queries, keys and values for their new tokens.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from conveyor.engine.attention.backend import AttentionSpec
from conveyor.engine.attention.metadata import AttentionMetadata


@dataclass(slots=True)
class RandomStep:
    spec: AttentionSpec
    meta: AttentionMetadata
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv_cache: torch.Tensor

    def to(self, device: str) -> RandomStep:
        m = self.meta
        meta = AttentionMetadata(
            *(t.to(device) for t in (m.slot_mapping, m.positions, m.token_request,
                                     m.query_start_loc, m.seq_lens, m.block_tables)),
            block_size=m.block_size, max_query_len=m.max_query_len, max_seq_len=m.max_seq_len)
        return RandomStep(self.spec, meta, self.query.to(device), self.key.to(device),
                          self.value.to(device), self.kv_cache.to(device))


def _shuffled_tables(seqs: list[tuple[int, int]], block_size: int,
                     seed: int) -> tuple[list[list[int]], int]:
    """Each request's block table, from a pool of their blocks and 3 more, shuffled."""
    need = [math.ceil((cached + new) / block_size) for cached, new in seqs]
    num_blocks = sum(need) + 3
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    return [[free.pop() for _ in range(n)] for n in need], num_blocks


def random_step(*, block_size: int, num_kv_heads: int, group: int, head_dim: int,
                seqs: list[tuple[int, int]], seed: int = 0, dtype=torch.float32,
                sliding_window: int | None = None, kv_dtype=None) -> RandomStep:
    """`seqs` lists (num_cached, num_new) per request. Blocks are handed out in a
    shuffled order so block tables are not contiguous; the pool's old context is random.
    kv_dtype: the pool's element type (None: dtype)."""
    gen = torch.Generator().manual_seed(seed)
    tables, num_blocks = _shuffled_tables(seqs, block_size, seed)
    block_tables = torch.zeros(len(seqs), max(map(len, tables)), dtype=torch.int32)
    slots, positions, owner, starts = [], [], [], [0]
    for row, ((cached, new), table) in enumerate(zip(seqs, tables, strict=True)):
        block_tables[row, :len(table)] = torch.tensor(table, dtype=torch.int32)
        for pos in range(cached, cached + new):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
            positions.append(pos)
            owner.append(row)
        starts.append(starts[-1] + new)
    num_tokens = len(slots)
    num_heads = num_kv_heads * group
    spec = AttentionSpec(num_heads, num_kv_heads, head_dim, head_dim ** -0.5, sliding_window,
                         dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), positions=torch.tensor(positions),
        token_request=torch.tensor(owner), query_start_loc=torch.tensor(starts),
        seq_lens=torch.tensor([c + n for c, n in seqs]), block_tables=block_tables,
        block_size=block_size, max_query_len=max(n for _, n in seqs),
        max_seq_len=max(c + n for c, n in seqs))

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    return RandomStep(
        spec=spec, meta=meta, query=randn(num_tokens, num_heads, head_dim),
        key=randn(num_tokens, num_kv_heads, head_dim),
        value=randn(num_tokens, num_kv_heads, head_dim),
        kv_cache=randn(2, num_blocks, block_size, num_kv_heads, head_dim).to(kv_dtype or dtype))
