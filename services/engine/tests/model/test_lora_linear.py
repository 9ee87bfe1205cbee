"""LoraLinear against a per-row reference (x @ A_s^T @ B_s added to the base output): the
native kernel (both code paths, fp32 and bf16) and the grouped torch ops, on steps mixing
base rows and adapters of different ranks in fused projections."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from conveyor.engine.lora import lora_linear
from conveyor.engine.lora.lora_linear import LoraBatch, LoraLinear, native_kernel

MAX_RANK = 8
SLICE_OUTS = (56, 12, 12)  # a small qkv_proj; not multiples of 16 or 8: the vector tails run
IN = 37


def _projection(dtype, max_loras=3, seed=0):
    torch.manual_seed(seed)
    batch = LoraBatch(max_loras, MAX_RANK, torch.device("cpu"))
    base = nn.Linear(IN, sum(SLICE_OUTS), bias=False).to(dtype)
    layer = LoraLinear(base, SLICE_OUTS, IN, batch, dtype, torch.device("cpu"))
    adapters = {}
    for slot, rank in enumerate((8, 3, 5)[:max_loras]):
        a = torch.zeros(len(SLICE_OUTS) * MAX_RANK, IN)
        b = torch.zeros(len(SLICE_OUTS) * MAX_RANK, sum(SLICE_OUTS))
        column = 0
        for i, width in enumerate(SLICE_OUTS):  # adapter.py's layout: block-diagonal b
            a[i * MAX_RANK:i * MAX_RANK + rank] = torch.randn(rank, IN)
            b[i * MAX_RANK:i * MAX_RANK + rank, column:column + width] = torch.randn(rank, width)
            column += width
        layer.set_slot(slot, (a.to(dtype), b.to(dtype)))
        batch.ranks[slot] = rank
        adapters[slot] = (a.to(dtype).float(), b.to(dtype).float())
    return layer, batch, adapters


def _reference(layer, adapters, x, slots):
    y = layer.base(x).float()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            a, b = adapters[slot]
            y[t] += x[t].float() @ a.t() @ b
    return y


def _set(monkeypatch, batch, slots, path):
    monkeypatch.setattr(lora_linear, "KERNEL", path)
    batch._kernel = None if path == "torch" else native_kernel()
    batch.set_step(slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["avx2", "avx512", "torch"])
@pytest.mark.parametrize("rows", [1, 7, 11, 33])  # groups of 1-4 rows of one slot
def test_each_row_gets_its_own_adapter(monkeypatch, dtype, path, rows):
    if path != "torch" and native_kernel() is None:
        pytest.skip("the LoRA kernel does not build here")
    if path == "avx512" and native_kernel().isa_name(0) != "avx512":
        pytest.skip("this CPU has no AVX-512")
    layer, batch, adapters = _projection(dtype)
    x = torch.randn(rows, IN).to(dtype)
    slots = np.array([(t % 4) - 1 for t in range(rows)], dtype=np.int64)  # -1, 0, 1, 2
    _set(monkeypatch, batch, slots, path)
    assert (batch.native is not None) == (path != "torch")
    got = layer(x).float()
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, _reference(layer, adapters, x, slots), rtol=tolerance,
                               atol=tolerance * 10)


def test_base_rows_are_the_base_output_bit_for_bit(monkeypatch):
    layer, batch, _ = _projection(torch.float32)
    x = torch.randn(5, IN)
    _set(monkeypatch, batch, np.array([-1, 0, -1, 1, -1]), "auto")
    got = layer(x)
    assert torch.equal(got[[0, 2, 4]], layer.base(x)[[0, 2, 4]])
    batch.set_step(None)  # a step without adapters: the base projection alone
    assert torch.equal(layer(x), layer.base(x))


def test_large_steps_take_the_grouped_ops(monkeypatch):
    layer, batch, adapters = _projection(torch.float32)
    rows = lora_linear.NATIVE_MAX_ROWS + 1
    x = torch.randn(rows, IN)
    slots = np.zeros(rows, dtype=np.int64)
    _set(monkeypatch, batch, slots, "auto")
    assert batch.native is None and batch.groups == [(0, None)]
    torch.testing.assert_close(layer(x), _reference(layer, adapters, x, slots), rtol=1e-4,
                               atol=1e-3)


def test_bad_slots_are_a_clear_error(monkeypatch):
    if native_kernel() is None:
        pytest.skip("the LoRA kernel does not build here")
    layer, batch, _ = _projection(torch.float32)
    _set(monkeypatch, batch, np.array([3]), "auto")
    with pytest.raises(RuntimeError, match="out of range"):
        layer(torch.randn(1, IN))
