"""Triton kernels against the torch backend on random paged steps.

On a machine without CUDA these run under TRITON_INTERPRET=1 (set in
conftest.py) on CPU tensors; shapes are kept small because the interpreter
is slow.
"""

from __future__ import annotations

import pytest
import torch

from conveyor.engine.attention import create_backend

pytest.importorskip("triton")

CASES = [
    # block_size, kv heads, group, head_dim, [(cached, new) per request]
    pytest.param(4, 2, 1, 16, [(0, 5), (7, 1), (3, 1)], id="bs4-mha-mixed"),
    pytest.param(8, 1, 4, 32, [(0, 1), (12, 1), (30, 1), (5, 1)], id="bs8-gqa4-decode"),
    pytest.param(16, 2, 3, 16, [(0, 9), (20, 4), (1, 1)], id="bs16-gqa3-prefill-chunks"),
    pytest.param(2, 1, 2, 8, [(45, 1), (0, 3)], id="bs2-many-blocks"),
    pytest.param(32, 2, 2, 64, [(70, 2), (0, 1)], id="bs32-hd64"),
]


def _run(name: str, step, kv_cache: torch.Tensor) -> torch.Tensor:
    backend = create_backend(name, step.spec)
    return backend.forward(step.query, step.key, step.value, kv_cache, backend.plan(step.meta))


@pytest.mark.parametrize(("block_size", "kv_heads", "group", "head_dim", "seqs"), CASES)
def test_triton_matches_torch(make_random_step, block_size, kv_heads, group, head_dim,
                              seqs):
    step = make_random_step(block_size=block_size, num_kv_heads=kv_heads, group=group,
                       head_dim=head_dim, seqs=seqs)
    torch_cache, triton_cache = step.kv_cache.clone(), step.kv_cache.clone()
    expected = _run("torch", step, torch_cache)
    actual = _run("triton", step, triton_cache)
    torch.testing.assert_close(triton_cache, torch_cache, rtol=0, atol=0)
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("block_size", "seqs", "window"), [
    pytest.param(4, [(10, 3), (2, 1)], 5, id="small"),
    pytest.param(8, [(40, 90), (3, 1), (0, 20)], 24, id="chunk-across-query-tiles"),
])
def test_triton_sliding_window_matches_torch(make_random_step, triton_device, block_size, seqs,
                                             window):
    step = make_random_step(block_size=block_size, num_kv_heads=1, group=2, head_dim=16,
                            seqs=seqs, sliding_window=window)
    expected = _run("torch", step, step.kv_cache.clone())
    on_device = step.to(triton_device)
    actual = _run("triton", on_device, on_device.kv_cache)
    torch.testing.assert_close(actual.cpu(), expected, rtol=1e-4, atol=1e-4)


def test_store_kv_writes_only_mapped_slots(make_random_step, triton_device):
    from conveyor.engine.attention.triton_backend import store_kv

    step = make_random_step(block_size=4, num_kv_heads=2, group=1, head_dim=8,
                            seqs=[(3, 4), (0, 2)])
    on_device = step.to(triton_device)
    store_kv(on_device.key, on_device.value, on_device.kv_cache, on_device.meta.slot_mapping)
    cache = on_device.kv_cache.cpu()
    flat_k = cache[0].view(-1, 2, 8)
    flat_v = cache[1].view(-1, 2, 8)
    torch.testing.assert_close(flat_k[step.meta.slot_mapping], step.key, rtol=0, atol=0)
    torch.testing.assert_close(flat_v[step.meta.slot_mapping], step.value, rtol=0, atol=0)
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[step.meta.slot_mapping] = False
    original = step.kv_cache[0].view(-1, 2, 8)
    torch.testing.assert_close(flat_k[untouched], original[untouched], rtol=0, atol=0)
