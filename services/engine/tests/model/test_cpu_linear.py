"""CpuLinear: same results as nn.Linear on one row and on many, names kept, packed
only where oneDNN takes the dtype; few-row steps through the streaming GEMV on a
row-major weight where it builds, the old column-major split where it does not."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conveyor.engine import native
from conveyor.engine.model import cpu_linear
from conveyor.engine.model.cpu_linear import (
    GEMV_MAX_ROWS,
    CpuLinear,
    gemv_ops,
    onednn_packing_available,
    use_cpu_linears,
)

needs_onednn = pytest.mark.skipif(not onednn_packing_available(torch.float32),
                                  reason="this torch build has no oneDNN prepacked linear")
needs_gemv = pytest.mark.skipif(gemv_ops() is None, reason="the GEMV does not build here")


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 7, 64])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("isa", ["auto", "avx2"])
def test_matches_linear(monkeypatch, rows: int, bias: bool, isa: str) -> None:
    monkeypatch.setattr(cpu_linear, "GEMV_ISA", cpu_linear.GEMV_ISAS[isa])
    torch.manual_seed(rows)
    linear = nn.Linear(96, 40, bias=bias)
    cpu = CpuLinear.from_linear(linear, pack=onednn_packing_available(torch.float32))
    x = torch.randn(rows, 96)
    torch.testing.assert_close(cpu(x), linear(x), rtol=1e-5, atol=1e-5)


GEMV_CASES = [(torch.float32, "auto"), (torch.float32, "avx2"), (torch.bfloat16, "auto"),
              (torch.bfloat16, "avx512"), (torch.bfloat16, "avx2")]
"""(weight dtype, GEMV code path) pairs the routing test runs; a path the CPU lacks skips."""


@needs_gemv
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("dtype", "isa"), GEMV_CASES, ids=[f"{d}-{i}" for d, i in GEMV_CASES])
def test_few_rows_take_the_gemv_on_the_row_major_weight_more_rows_onednn(
        monkeypatch, threads: int, dtype: torch.dtype, isa: str) -> None:
    if not onednn_packing_available(dtype):
        pytest.skip(f"no oneDNN prepacked {dtype} linear here")
    ops = gemv_ops(dtype)
    code = cpu_linear.GEMV_ISAS[isa]
    try:
        path = cpu_linear.gemv_path(ops, dtype, code)
    except RuntimeError:
        pytest.skip(f"this CPU lacks the {isa} path")
    monkeypatch.setattr(cpu_linear, "GEMV_ISA" if dtype == torch.float32 else "BF16_GEMV_ISA",
                        code)
    linear = nn.Linear(32, 16).to(dtype)
    cpu = CpuLinear.from_linear(linear, pack=True)
    assert cpu.streams and cpu.packed and cpu.weight.is_contiguous()
    assert cpu.weight.data_ptr() == linear.weight.data_ptr()  # no copy of its own
    gemv_calls, packed_calls = [], []
    entry = cpu_linear.GEMV_ENTRIES[dtype]
    real_gemv, real_packed = getattr(ops, entry), torch.ops.mkldnn._linear_pointwise

    def gemv_spy(x, weight, bias, code):
        gemv_calls.append((x.shape[0], code))
        return real_gemv(x, weight, bias, code)

    def packed_spy(*args):
        packed_calls.append(args[0].shape[0])
        return real_packed(*args)

    monkeypatch.setattr(ops, entry, gemv_spy)
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", packed_spy)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    most = GEMV_MAX_ROWS[dtype][path]
    assert (cpu.gemv_path, cpu.gemv_max_rows) == (path, most)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    for rows in range(1, most + 2):
        x = torch.randn(rows, 32, dtype=dtype)
        torch.testing.assert_close(cpu(x), linear(x), rtol=tolerance, atol=tolerance)
    assert gemv_calls == [(rows, code) for rows in range(1, most + 1)]
    assert packed_calls == [most + 1]


@needs_onednn
@pytest.mark.parametrize(("threads", "packed_rows"), [(1, [5]), (2, [1, 5])])
def test_without_the_gemv_rows_take_the_packed_kernel_and_one_row_on_one_thread_mkl(
        monkeypatch, threads: int, packed_rows: list[int]) -> None:
    linear = nn.Linear(32, 16, bias=False)
    cpu = CpuLinear.from_linear(linear, pack=True, gemv=False)
    assert cpu.packed and not cpu.streams and cpu.weight.t().is_contiguous()
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


@pytest.fixture
def fresh_gemv_ops():
    """gemv_ops() probed anew inside the test and again after it."""
    gemv_ops.cache_clear()
    yield
    gemv_ops.cache_clear()


def test_no_gemv_build_falls_back_to_the_column_major_split_logged_once(
        monkeypatch, caplog, fresh_gemv_ops) -> None:
    def no_compiler(*args, **kwargs):
        raise native.NativeBuildError("native extension conveyor_gemv did not build: "
                                      "no c++ compiler")

    monkeypatch.setattr(native, "load_extension", no_compiler)
    caplog.set_level(logging.WARNING, logger=cpu_linear.logger.name)
    linears = [CpuLinear.from_linear(nn.Linear(24, 8), pack=False) for _ in range(3)]
    assert not any(cpu.streams for cpu in linears)
    assert all(cpu.weight.t().is_contiguous() for cpu in linears)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "fp32 GEMV unavailable" in warnings[0]
    assert "no c++ compiler" in warnings[0]
    x = torch.randn(1, 24)
    torch.testing.assert_close(linears[0](x), F.linear(x, linears[0].weight, linears[0].bias))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gemv_can_be_switched_off_per_dtype(monkeypatch, fresh_gemv_ops, dtype) -> None:
    monkeypatch.setenv(cpu_linear.GEMV_SWITCHES[dtype], "off")
    assert gemv_ops(dtype) is None
    assert not CpuLinear.from_linear(nn.Linear(8, 4).to(dtype), pack=False).streams


def test_use_cpu_linears_keeps_names_and_values() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4, bias=False)))
    before = {name: p.clone() for name, p in model.named_parameters()}
    assert use_cpu_linears(model, torch.float32) == 2
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    for name, value in before.items():
        assert torch.equal(after[name], value)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())


@pytest.mark.skipif(not onednn_packing_available(torch.bfloat16),
                    reason="this torch build or CPU has no oneDNN bf16 linear")
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_bfloat16_is_packed_and_matches_linear(rows: int) -> None:
    torch.manual_seed(rows)
    linear = nn.Linear(64, 24).to(torch.bfloat16)
    model = nn.Sequential(linear)
    use_cpu_linears(model, torch.bfloat16)
    assert isinstance(model[0], CpuLinear) and model[0].packed
    x = torch.randn(rows, 64, dtype=torch.bfloat16)
    out = model(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, linear(x), rtol=1e-2, atol=1e-2)


def test_float16_is_not_packed() -> None:
    assert not onednn_packing_available(torch.float16)
