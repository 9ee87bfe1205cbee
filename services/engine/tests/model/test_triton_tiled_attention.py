"""The tiled Triton attention against the torch backend on random mixed paged steps.

Each step mixes first prefill chunks, later chunks after a prefix-cache hit or an
earlier chunk, and decode rows, with chunks longer than one query tile, so tiles
start mid-request and cover the prefix context and the chunk's own causal part.
Runs under TRITON_INTERPRET=1 on the CPU (conftest.py) with derandomized shapes.
"""

from __future__ import annotations

import random

import pytest
import torch

from conveyor.engine.attention import create_backend
from conveyor.engine.attention.metadata import PADDING_SLOT

pytest.importorskip("triton")

from conveyor.engine.attention.triton_backend import (  # noqa: E402
    num_tiles,
    store_kv,
    tile_shape,
)

SHAPES = [
    # block_size, kv heads, group, head_dim
    pytest.param(16, 2, 1, 32, id="bs16-mha"),
    pytest.param(8, 1, 3, 16, id="bs8-gqa3"),
    pytest.param(4, 2, 4, 64, id="bs4-gqa4-hd64"),
    pytest.param(32, 1, 2, 24, id="bs32-gqa2-hd24"),
    pytest.param(64, 1, 2, 16, id="bs64-wider-than-a-key-tile"),
]


def mixed_seqs(rng: random.Random, block_size: int) -> list[tuple[int, int]]:
    """(num_cached, num_new) rows: a first chunk past one tile, a chunk after a prefix
    hit (whole blocks cached), a later chunk at an odd offset, and decode rows."""
    rows = [(0, rng.randint(65, 140)),
            (block_size * rng.randint(1, 6), rng.randint(2, 40)),
            (rng.randint(1, 90), rng.randint(2, 30))]
    rows += [(rng.randint(1, 120), 1) for _ in range(rng.randint(1, 4))]
    rng.shuffle(rows)
    return rows


def _run(name: str, step, kv_cache: torch.Tensor) -> torch.Tensor:
    backend = create_backend(name, step.spec)
    return backend.forward(step.query, step.key, step.value, kv_cache, backend.plan(step.meta))


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(("block_size", "kv_heads", "group", "head_dim"), SHAPES)
def test_mixed_step_matches_torch(make_random_step, triton_device, seed, block_size, kv_heads,
                                  group, head_dim):
    seqs = mixed_seqs(random.Random(seed * 100 + block_size), block_size)
    step = make_random_step(block_size=block_size, num_kv_heads=kv_heads, group=group,
                            head_dim=head_dim, seqs=seqs, seed=seed)
    torch_cache = step.kv_cache.clone()
    expected = _run("torch", step, torch_cache)
    on_device = step.to(triton_device)
    actual = _run("triton", on_device, on_device.kv_cache)
    torch.testing.assert_close(on_device.kv_cache.cpu(), torch_cache, rtol=0, atol=0)
    torch.testing.assert_close(actual.cpu(), expected, rtol=1e-4, atol=1e-4)


def test_mixed_step_in_bfloat16_tracks_torch(make_random_step, triton_device):
    step = make_random_step(block_size=16, num_kv_heads=2, group=2, head_dim=32,
                            seqs=[(0, 70), (32, 9), (50, 1), (7, 1)], dtype=torch.bfloat16)
    expected = _run("torch", step, step.kv_cache.clone()).float()
    on_device = step.to(triton_device)
    actual = _run("triton", on_device, on_device.kv_cache).cpu().float()
    assert ((actual - expected).abs() <= 2e-2 * (1 + expected.abs())).all()


def test_padding_slots_write_nothing(make_random_step, triton_device):
    step = make_random_step(block_size=4, num_kv_heads=2, group=1, head_dim=8,
                            seqs=[(3, 1), (5, 1), (0, 1)]).to(triton_device)
    slots = step.meta.slot_mapping.clone()
    slots[1] = PADDING_SLOT
    before = step.kv_cache.clone()
    store_kv(step.key, step.value, step.kv_cache, slots)
    flat, flat_before = step.kv_cache.view(2, -1, 2, 8), before.view(2, -1, 2, 8)
    written = slots[slots >= 0]
    torch.testing.assert_close(flat[0, written], step.key[[0, 2]], rtol=0, atol=0)
    untouched = torch.ones(flat.shape[1], dtype=torch.bool, device=flat.device)
    untouched[written] = False
    torch.testing.assert_close(flat[:, untouched], flat_before[:, untouched], rtol=0, atol=0)


def test_decode_steps_take_one_token_tiles_and_prefill_wide_ones():
    assert tile_shape(group=4, max_query_len=1).block_q == 1
    assert tile_shape(group=4, max_query_len=1).block_m == 16  # tl.dot's minimum
    wide = tile_shape(group=3, max_query_len=300)
    assert (wide.block_m, wide.block_q) == (64, 21)
    assert tile_shape(group=128, max_query_len=5).block_q == 1  # one token's heads fill it


@pytest.mark.parametrize("block_q", [1, 5, 21, 64])
def test_tile_grid_gives_every_token_one_tile(block_q):
    """The kernel's layout: request b's tiles start at start_b // block_q + b; every
    query token falls in exactly one tile inside the grid, tiles never overlap."""
    rng = random.Random(block_q)
    query_lens = [rng.choice([1, 1, 2, block_q, block_q + 1, 3 * block_q + 2])
                  for _ in range(12)]
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    grid = num_tiles(starts[-1], len(query_lens), block_q)
    owners: dict[int, int] = {}
    for b, n in enumerate(query_lens):
        first = starts[b] if block_q == 1 else starts[b] // block_q + b
        for t in range(-(-n // block_q)):
            assert first + t < grid and first + t not in owners
            owners[first + t] = b
    assert sum(-(-n // block_q) for n in query_lens) == len(owners)
