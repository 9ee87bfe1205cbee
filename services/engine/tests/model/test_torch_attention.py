"""The torch backend (the reference) against a naive per-request loop."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conveyor.engine.attention import BACKEND_NAMES, create_backend


def naive_attention(step) -> torch.Tensor:
    """Dense attention per request, from the pool after the new K/V are stored."""
    meta, spec = step.meta, step.spec
    keys = step.kv_cache[0].view(-1, spec.num_kv_heads, spec.head_dim).clone()
    values = step.kv_cache[1].view(-1, spec.num_kv_heads, spec.head_dim).clone()
    keys[meta.slot_mapping] = step.key
    values[meta.slot_mapping] = step.value
    out = torch.empty_like(step.query)
    for t in range(meta.num_tokens):
        row, pos = int(meta.token_request[t]), int(meta.positions[t])
        ctx = torch.arange(pos + 1)
        if spec.sliding_window is not None:
            ctx = ctx[ctx > pos - spec.sliding_window]
        table = meta.block_tables[row].long()
        slots = table[ctx // meta.block_size] * meta.block_size + ctx % meta.block_size
        k = keys[slots].repeat_interleave(spec.num_queries_per_kv, dim=1)  # [S, H, D]
        v = values[slots].repeat_interleave(spec.num_queries_per_kv, dim=1)
        scores = torch.einsum("hd,shd->hs", step.query[t], k) * spec.scale
        out[t] = torch.einsum("hs,shd->hd", scores.softmax(-1), v)
    return out


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize(("block_size", "group"), [(4, 1), (16, 3), (8, 4)])
def test_torch_backend_matches_naive(make_random_step, block_size, group, window):
    step = make_random_step(block_size=block_size, num_kv_heads=2, group=group, head_dim=16,
                            seqs=[(0, 11), (9, 1), (30, 5), (1, 1)], sliding_window=window)
    backend = create_backend("torch", step.spec)
    cache = step.kv_cache.clone()
    actual = backend.forward(step.query, step.key, step.value, cache, backend.plan(step.meta))
    torch.testing.assert_close(actual, naive_attention(step), rtol=1e-5, atol=1e-5)


def test_registry_names_and_unknown_backend(make_random_step):
    assert set(BACKEND_NAMES) == {"torch", "triton", "native"}
    step = make_random_step(block_size=4, num_kv_heads=1, group=1, head_dim=8, seqs=[(0, 1)])
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        create_backend("flash", step.spec)


@pytest.mark.parametrize("seqs", [[(0, 7), (0, 7), (5, 1)], [(0, 16), (0, 16)], [(3, 1), (8, 1)],
                                  [(0, 7), (2, 7)]])
def test_torch_backend_fast_paths_match_naive(make_random_step, seqs):
    """Uniform first chunks take plain causal SDPA (no mask), decode-only steps skip the
    query grid; both must agree with the naive loop."""
    step = make_random_step(block_size=4, num_kv_heads=2, group=2, head_dim=16, seqs=seqs)
    backend = create_backend("torch", step.spec)
    plan = backend.plan(step.meta)
    chunks = [(done, n) for done, n in seqs if n > 1]
    if chunks and all(done == 0 for done, _ in chunks) and len({n for _, n in chunks}) == 1:
        assert plan.groups[-1].mask is None
    cache = step.kv_cache.clone()
    actual = backend.forward(step.query, step.key, step.value, cache, plan)
    torch.testing.assert_close(actual, naive_attention(step), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_masks_are_boolean_and_16_bit_steps_match_naive(make_random_step, dtype):
    """A boolean mask, whatever the dtype: SDPA's cuDNN kernel misread the fp32 additive
    mask this plan used to build under 16-bit queries on an H200 (NaN in float16;
    tests/gpu/test_triton_vs_torch.py shows it there)."""
    step = make_random_step(block_size=4, num_kv_heads=2, group=3, head_dim=16,
                            seqs=[(0, 9), (12, 1), (30, 4)], dtype=dtype)
    backend = create_backend("torch", step.spec)
    plan = backend.plan(step.meta)
    assert {group.mask.dtype for group in plan.groups} == {torch.bool}
    actual = backend.forward(step.query, step.key, step.value, step.kv_cache.clone(), plan)
    expected = naive_attention(dataclasses.replace(step, query=step.query.float(),
                                                   key=step.key.float(),
                                                   value=step.value.float(),
                                                   kv_cache=step.kv_cache.float()))
    torch.testing.assert_close(actual.float(), expected, rtol=2e-2, atol=2e-2)
