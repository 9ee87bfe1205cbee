"""CpuLinear: same results as nn.Linear on one row and on many, names kept, packed
only where oneDNN takes the dtype."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conveyor.engine.model.cpu_linear import CpuLinear, onednn_packing_available, use_cpu_linears

needs_onednn = pytest.mark.skipif(not onednn_packing_available(torch.float32),
                                  reason="this torch build has no oneDNN prepacked linear")


@pytest.mark.parametrize("rows", [0, 1, 2, 7, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_linear(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    linear = nn.Linear(96, 40, bias=bias)
    cpu = CpuLinear.from_linear(linear, pack=onednn_packing_available(torch.float32))
    x = torch.randn(rows, 96)
    torch.testing.assert_close(cpu(x), linear(x), rtol=1e-5, atol=1e-5)


@needs_onednn
@pytest.mark.parametrize(("threads", "packed_rows"), [(1, [5]), (2, [1, 5])])
def test_rows_take_the_packed_kernel_and_one_row_on_one_thread_the_column_major_weight(
        monkeypatch, threads: int, packed_rows: list[int]) -> None:
    linear = nn.Linear(32, 16, bias=False)
    cpu = CpuLinear.from_linear(linear, pack=True)
    assert cpu.packed and cpu.weight.t().is_contiguous()
    calls = []
    real = torch.ops.mkldnn._linear_pointwise

    def spy(*args):
        calls.append(args[0].shape[0])
        return real(*args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    out = cpu(torch.randn(1, 32))
    cpu(torch.randn(5, 32))
    assert calls == packed_rows
    assert out.shape == (1, 16)


@needs_onednn
def test_leading_dims_are_kept() -> None:
    linear = nn.Linear(24, 8)
    cpu = CpuLinear.from_linear(linear, pack=True)
    x = torch.randn(3, 4, 24)
    out = cpu(x)
    assert out.shape == (3, 4, 8)
    torch.testing.assert_close(out, F.linear(x, linear.weight, linear.bias), rtol=1e-5,
                               atol=1e-5)


def test_use_cpu_linears_keeps_names_and_values() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4, bias=False)))
    before = {name: p.clone() for name, p in model.named_parameters()}
    assert use_cpu_linears(model, torch.float32) == 2
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    for name, value in before.items():
        assert torch.equal(after[name], value)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())


def test_bfloat16_is_not_packed() -> None:
    assert not onednn_packing_available(torch.bfloat16)
    model = nn.Sequential(nn.Linear(8, 8).to(torch.bfloat16))
    use_cpu_linears(model, torch.bfloat16)
    assert isinstance(model[0], CpuLinear) and not model[0].packed
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    assert model(x).dtype == torch.bfloat16
