"""The opt-in weight formats: block kernels against dequantize-then-matmul, lossless
recovery of GGUF blocks, the row limit, the fallback and the setting's validation."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from conveyor.engine.model import quantized_linear as ql
from conveyor.engine.model.cpu_linear import CpuLinear, onednn_packing_available
from conveyor.engine.model.quantized_linear import (
    FormatUnavailable,
    Fp16Weight,
    Q4_1Weight,
    Q8_0Weight,
    QuantizedLinear,
    quantize_linears,
)

TOLERANCE = 1e-5
"""Largest |kernel - reference| relative to the reference's largest |value| (fp32 sums of
a few hundred products against an fp64 reference)."""


@pytest.fixture(scope="module")
def kernels():
    try:
        return ql.block_kernels()
    except FormatUnavailable as exc:
        pytest.skip(f"block kernels unavailable here: {exc}")


def _relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return float((out.double() - reference).abs().max() / reference.abs().max())


@pytest.mark.parametrize("weight_class", [Q8_0Weight, Q4_1Weight])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9])
def test_block_kernel_matches_dequantize_then_matmul(kernels, weight_class, rows: int) -> None:
    torch.manual_seed(rows)
    weights = weight_class(torch.randn(72, 160))
    x = torch.randn(rows, 160)
    reference = x.double() @ weights.dequantize().double().t()
    assert _relative_error(weights.matmul(x), reference) < TOLERANCE


def _gguf_q4_1(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 weights as gguf-py dequantizes random Q4_1 blocks (d * q + m in fp32), each
    block holding q = 0 and q = 15 as llama.cpp's quantizer leaves them; and the q values."""
    blocks = cols // 32
    q = torch.randint(0, 16, (rows, blocks, 32))
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(rows, blocks, 1) * 0.01 + 1e-4).half().float()
    m = (torch.randn(rows, blocks, 1) * 0.05).half().float()
    return (d * q.float() + m).reshape(rows, cols), q


def test_q4_1_recovers_gguf_blocks_exactly(kernels) -> None:
    torch.manual_seed(0)
    weight, q = _gguf_q4_1(64, 128)
    weights = Q4_1Weight(weight)
    assert torch.equal(weights.dequantize(), weight)
    nibbles = torch.cat([weights.qs.reshape(64, 4, 16) & 0x0F,
                         weights.qs.reshape(64, 4, 16) >> 4], dim=-1)
    assert torch.equal(nibbles.long(), q)


def test_q8_0_recovers_gguf_blocks_exactly(kernels) -> None:
    torch.manual_seed(0)
    q = torch.randint(-127, 128, (64, 4, 32))
    q[..., 0] = 127
    d = (torch.rand(64, 4, 1) * 0.01 + 1e-4).half().float()
    weight = (d * q.float()).reshape(64, 128)
    assert torch.equal(Q8_0Weight(weight).dequantize(), weight)


def test_fp16_matches_the_rounded_weight() -> None:
    torch.manual_seed(0)
    weight = torch.randn(40, 96)
    x = torch.randn(3, 96)
    reference = x.double() @ weight.half().double().t()
    assert _relative_error(Fp16Weight(weight).matmul(x), reference) < TOLERANCE


def _layer(weight_class, *, bias: bool = False, max_rows: int = 8) -> QuantizedLinear:
    torch.manual_seed(1)
    dense = CpuLinear.from_linear(nn.Linear(64, 48, bias=bias),
                                  pack=onednn_packing_available(torch.float32))
    return QuantizedLinear(dense, weight_class(dense.weight), max_rows=max_rows)


@pytest.mark.parametrize("rows", [1, 8, 9, 40])
def test_format_reads_up_to_max_rows_and_fp32_above(kernels, rows: int, monkeypatch) -> None:
    layer = _layer(Q4_1Weight, bias=True)
    calls = []
    real = layer.weights.matmul
    monkeypatch.setattr(layer.weights, "matmul", lambda x: calls.append(len(x)) or real(x))
    x = torch.randn(rows, 64)
    out = layer(x)
    if rows <= layer.max_rows:
        assert calls == [rows]
        reference = x.double() @ layer.weights.dequantize().double().t()
        reference += layer.dense.bias.double()
        assert _relative_error(out, reference) < TOLERANCE
    else:
        assert calls == []
        assert torch.equal(out, layer.dense(x))


def test_keeps_leading_dimensions(kernels) -> None:
    layer = _layer(Q8_0Weight)
    assert layer(torch.randn(1, 1, 64)).shape == (1, 1, 48)


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        pack = onednn_packing_available(torch.float32)
        self.proj = CpuLinear.from_linear(nn.Linear(64, 64, bias=False), pack=pack)
        self.lm_head = CpuLinear.from_linear(nn.Linear(64, 100, bias=False), pack=pack)


def test_q4_1_puts_the_vocabulary_projection_in_q8_0(kernels) -> None:
    model = _Tiny()
    active = quantize_linears(model, "q4_1")
    assert active.startswith("q4_1 (lm_head q8_0)")
    assert model.proj.weight_format == "q4_1" and model.lm_head.weight_format == "q8_0"


def test_fp32_changes_nothing() -> None:
    model = _Tiny()
    assert quantize_linears(model, "fp32") == "fp32"
    assert isinstance(model.proj, CpuLinear)


def test_missing_kernels_leave_fp32_with_a_warning(monkeypatch, caplog) -> None:
    def unavailable():
        raise FormatUnavailable("native extension did not build: no compiler")

    monkeypatch.setattr(ql, "block_kernels", unavailable)
    model = _Tiny()
    with caplog.at_level(logging.WARNING, logger=ql.__name__):
        assert quantize_linears(model, "q4_1") == "fp32"
    assert isinstance(model.proj, CpuLinear) and isinstance(model.lm_head, CpuLinear)
    assert "weights stay fp32: native extension did not build" in caplog.text


def test_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="weight_format 'q5_0' is not one of"):
        quantize_linears(_Tiny(), "q5_0")


def test_setting_names_the_variable() -> None:
    from conveyor.engine.settings import EngineSettings

    assert EngineSettings(weight_format="q4_1").resolved_weight_format() == "q4_1"
    with pytest.raises(ValueError, match="change CONVEYOR_ENGINE_WEIGHT_FORMAT"):
        EngineSettings(weight_format="int3").resolved_weight_format()


@pytest.mark.parametrize(("device", "dtype"), [("cuda", "bfloat16"), ("cuda", "float32"),
                                               ("cpu", "bfloat16")])
def test_formats_need_the_cpu_in_float32(device: str, dtype: str) -> None:
    from conveyor.engine.engine_factory import _in_setting_names
    from conveyor.engine.worker.runner_config import RunnerConfig

    config = RunnerConfig(model="m", device=device, dtype=dtype, weight_format="q4_1")
    with pytest.raises(ValueError, match="kernels on the CPU in float32 only") as error:
        config.validate()
    assert "change CONVEYOR_ENGINE_WEIGHT_FORMAT to fp32" in _in_setting_names(str(error.value))
    RunnerConfig(model="m", device=device, dtype=dtype).validate()  # fp32 weights: fine
