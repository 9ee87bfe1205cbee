"""The opt-in weight formats: block kernels against dequantize-then-matmul, lossless
recovery of GGUF blocks, the row limit, the fallback and the setting's validation."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from conveyor.engine.model import block_weights as bw
from conveyor.engine.model import quantized_linear as ql
from conveyor.engine.model.block_weights import (
    BLOCK,
    FormatUnavailable,
    Fp16Weight,
    Q4_1Int8Weight,
    Q4_1Weight,
    Q8_0Int8Weight,
    Q8_0Weight,
)
from conveyor.engine.model.cpu_linear import CpuLinear, onednn_packing_available
from conveyor.engine.model.quantized_linear import QuantizedLinear, quantize_linears

TOLERANCE = 1e-5
"""Largest |kernel - reference| relative to the reference's largest |value| (fp32 sums of
a few hundred products against an fp64 reference)."""


@pytest.fixture(scope="module")
def kernels():
    try:
        return bw.block_kernels()
    except FormatUnavailable as exc:
        pytest.skip(f"block kernels unavailable here: {exc}")


def _relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return float((out.double() - reference).abs().max() / reference.abs().max())


@pytest.fixture(params=[bw.ISA_AVX2, bw.ISA_AVX512], ids=["avx2", "avx512"])
def isa(request, kernels) -> int:
    """Each code path of the block kernels (AVX-512 where this CPU has it)."""
    if request.param == bw.ISA_AVX512 and not kernels.has_avx512():
        pytest.skip("this CPU lacks AVX-512")
    return request.param


@pytest.mark.parametrize("weight_class", [Q8_0Weight, Q4_1Weight])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 17])
@pytest.mark.parametrize("cols", [160, 2080])  # 5 blocks (unroll tails), 65 (scale chunks)
def test_block_kernel_matches_dequantize_then_matmul(isa, weight_class, rows: int,
                                                      cols: int) -> None:
    torch.manual_seed(rows)
    weights = weight_class(torch.randn(72, cols), isa=isa)
    x = torch.randn(rows, cols)
    reference = x.double() @ weights.dequantize().double().t()
    assert _relative_error(weights.matmul(x), reference) < TOLERANCE


@pytest.mark.parametrize("weight_class", [Q8_0Weight, Q4_1Weight, Q8_0Int8Weight, Q4_1Int8Weight])
def test_a_row_computes_the_same_at_any_row_count(isa, weight_class) -> None:
    torch.manual_seed(0)
    weights = weight_class(torch.randn(40, 2080), isa=isa)
    if weight_class in (Q8_0Int8Weight, Q4_1Int8Weight) and isa == bw.ISA_AVX512 \
            and not weights._kernels.has_vnni():
        pytest.skip("this CPU lacks AVX-512 VNNI")
    x = torch.randn(9, 2080)
    alone = weights.matmul(x[:1].contiguous())
    for rows in range(2, 10):
        assert torch.equal(weights.matmul(x[:rows].contiguous())[:1], alone), rows


def _round_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x with each block of 32 rounded to int8 times max|x| / 127 (as the int8 kernels do),
    and those scales."""
    blocks = x.reshape(x.shape[0], -1, BLOCK)
    scale = blocks.abs().amax(-1) / 127
    inverse = torch.where(scale > 0, 1.0 / scale, 0.0)
    rounded = torch.round(blocks * inverse[..., None]) * scale[..., None]
    return rounded.reshape(x.shape), scale


@pytest.fixture(params=[bw.ISA_AVX2, bw.ISA_AVX512], ids=["avx2", "avx512vnni"])
def int8_isa(request, kernels) -> int:
    """Each code path of the int8-activation kernels (VNNI where this CPU has it)."""
    if request.param == bw.ISA_AVX512 and not kernels.has_vnni():
        pytest.skip("this CPU lacks AVX-512 VNNI")
    return request.param


@pytest.mark.parametrize("weight_class", [Q8_0Int8Weight, Q4_1Int8Weight])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9])
@pytest.mark.parametrize("cols", [160, 2080])  # a part group of 8 blocks; 65 blocks
@pytest.mark.parametrize("out_features", [72, 13])  # 9 groups of 8 rows; a padded last group
def test_int8_kernel_is_the_product_with_rounded_activations(int8_isa, weight_class, rows: int,
                                                             cols: int, out_features: int) -> None:
    torch.manual_seed(rows)
    weights = weight_class(torch.randn(out_features, cols), isa=int8_isa)
    x = torch.randn(rows, cols)
    x[0, :BLOCK] = 0.0  # an all-zero block (scale 0)
    rounded, scale = _round_activations(x)
    weight = weights.dequantize().double()
    if weight_class is Q4_1Int8Weight:  # the offset term m * sum(x) uses the fp32 x
        offset = weights.m.double().repeat_interleave(BLOCK, dim=1)
        reference = rounded.double() @ (weight - offset).t() + x.double() @ offset.t()
    else:
        reference = rounded.double() @ weight.t()
    out = weights.matmul(x)
    assert _relative_error(out, reference) < TOLERANCE
    # against the exact product: off by at most the rounding, sum_b (scale_b / 2) sum |w_b|
    assert out.shape == (rows, out_features)
    block_abs = weight.abs().reshape(out_features, -1, BLOCK).sum(-1)
    bound = (scale.double()[:, None, :] / 2 * block_abs[None]).sum(-1)
    exact = x.double() @ weight.t()
    assert bool(((out.double() - exact).abs() <= bound + TOLERANCE * exact.abs().max()).all())


@pytest.mark.parametrize("weight_class, plain_class", [(Q8_0Int8Weight, Q8_0Weight),
                                                       (Q4_1Int8Weight, Q4_1Weight)])
def test_int8_formats_pack_eight_rows_a_vector(kernels, weight_class, plain_class) -> None:
    """The layout rows8_i8_linear.cpp reads: per group of 8 rows and block, byte 4j + t of the
    block's p-th 32-byte vector is row j's block byte 4p + t; then the 8 rows' scales (and
    q4_1's offsets). Unpacking gives the plain format's blocks back, the padding rows dropped."""
    torch.manual_seed(0)
    weight = torch.randn(13, 96)  # 2 groups (3 padding rows), 3 blocks
    packed, plain = weight_class(weight), plain_class(weight)
    block_bytes = plain.qs.shape[1] // 3
    vectors = packed.qs8.reshape(2, 3, block_bytes // 4, 8, 4)  # group, block, p, row, t
    for row, block, p, t in ((0, 0, 0, 0), (9, 2, 1, 3), (12, 1, block_bytes // 4 - 1, 2)):
        byte = plain.qs[row, block * block_bytes + 4 * p + t]
        assert vectors[row // 8, block, p, row % 8, t] == byte
    assert bool((vectors[1, :, :, 5:] == 0).all()), "padding rows are zero"
    scales = (packed.dm8 if weight_class is Q4_1Int8Weight else packed.d8).reshape(2, 3, -1, 8)
    assert scales[1, 2, 0, 4] == plain.d[12, 2]
    if weight_class is Q4_1Int8Weight:
        assert scales[0, 1, 1, 3] == plain.m[3, 1]
        assert torch.equal(packed.m, plain.m)
    assert torch.equal(packed.qs, plain.qs) and torch.equal(packed.d, plain.d)
    assert torch.equal(packed.dequantize(), plain.dequantize())


@pytest.mark.parametrize("weight_class", [Q8_0Int8Weight, Q4_1Int8Weight])
def test_int8_code_paths_agree_bit_for_bit(kernels, weight_class) -> None:
    """AVX2 (maddubs + madd) and VNNI (vpdpbusd) sum the same integers, then do the same fp32
    operations in the same order."""
    if not kernels.has_vnni():
        pytest.skip("this CPU lacks AVX-512 VNNI")
    torch.manual_seed(1)
    weights, x = weight_class(torch.randn(40, 2080)), torch.randn(6, 2080)
    weights.isa = bw.ISA_AVX2
    avx2 = weights.matmul(x)
    weights.isa = bw.ISA_AVX512
    assert torch.equal(weights.matmul(x), avx2)


def test_int8_kernels_refuse_a_layout_that_does_not_fit(kernels) -> None:
    weights, x = Q4_1Int8Weight(torch.randn(16, 64)), torch.randn(1, 64)
    with pytest.raises(RuntimeError, match="packed weights must be contiguous bytes"):
        kernels.q4_1_linear_i8(x, weights.qs8[:, :-1].contiguous(), weights.dm8)
    with pytest.raises(RuntimeError, match="packed scales must be contiguous fp16"):
        kernels.q8_0_linear_i8(x, Q8_0Int8Weight(torch.randn(16, 64)).qs8, weights.dm8)
    with pytest.raises(RuntimeError, match="K must be a multiple of 32"):
        kernels.q4_1_linear_i8(torch.randn(1, 48), weights.qs8, weights.dm8)


def test_q4_1_int8_puts_the_vocabulary_projection_in_q8_0_int8(kernels) -> None:
    model = _Tiny()
    assert quantize_linears(model, "q4_1_int8").startswith("q4_1_int8 (lm_head q8_0_int8)")
    assert isinstance(model.proj.weights, Q4_1Int8Weight)
    assert isinstance(model.lm_head.weights, Q8_0Int8Weight)


def test_auto_isa_takes_avx512_where_the_cpu_has_it(kernels) -> None:
    expected = "avx512" if kernels.has_avx512() else "avx2"
    assert kernels.isa_name(bw.ISA_AUTO) == expected
    assert kernels.isa_name(bw.ISA_AVX2) == "avx2"
    with pytest.raises(RuntimeError, match="isa must be 0"):
        kernels.isa_name(3)


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


@pytest.mark.parametrize("weight_format, max_rows", [("q4_1", 8), ("q4_1_int8", 32)])
def test_each_format_reads_up_to_its_own_row_limit(kernels, weight_format, max_rows) -> None:
    model = _Tiny()
    quantize_linears(model, weight_format)
    assert model.proj.max_rows == model.lm_head.max_rows == max_rows


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

    monkeypatch.setattr(bw, "block_kernels", unavailable)
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
    assert EngineSettings(weight_format="q4_1_int8").resolved_weight_format() == "q4_1_int8"
    with pytest.raises(ValueError, match="change CONVEYOR_ENGINE_WEIGHT_FORMAT"):
        EngineSettings(weight_format="int3").resolved_weight_format()


@pytest.mark.parametrize(("device", "dtype"), [("cuda", "bfloat16"), ("cuda", "float32"),
                                               ("cpu", "bfloat16")])
def test_formats_need_the_cpu_in_float32(device: str, dtype: str) -> None:
    from conveyor.engine.core.config import EngineConfig
    from conveyor.engine.engine_factory import _in_setting_names

    with pytest.raises(ValueError, match="kernels on the CPU in float32 only") as error:
        EngineConfig(model="m", device=device, dtype=dtype, weight_format="q4_1")
    assert "change CONVEYOR_ENGINE_WEIGHT_FORMAT to fp32" in _in_setting_names(str(error.value))
    EngineConfig(model="m", device=device, dtype=dtype)  # fp32 weights: fine


def test_speculative_settings_name_themselves() -> None:
    from conveyor.engine.settings import EngineSettings

    assert EngineSettings().resolved_draft_model() is None  # speculation off
    assert EngineSettings(num_speculative_tokens=3).resolved_draft_model() is None  # ngram
    draft = EngineSettings(num_speculative_tokens=3, speculative_method="draft")
    assert draft.resolved_draft_model() == draft.model
    with pytest.raises(ValueError, match="CONVEYOR_ENGINE_SPECULATIVE_METHOD"):
        EngineSettings(speculative_method="eagle").resolved_draft_model()
    with pytest.raises(ValueError, match="CONVEYOR_ENGINE_SPECULATIVE_DRAFT_WEIGHT_FORMAT"):
        EngineSettings(num_speculative_tokens=3, speculative_method="draft",
                       speculative_draft_weight_format="int3").resolved_draft_model()


def test_a_quantized_draft_model_runs_in_float32_on_the_cpu_only() -> None:
    """Beside a bfloat16 model the q4_1_int8 draft (speculative decoding) is float32, with
    its own float32 KV pool; on a GPU a draft model is refused, the setting named."""
    from conveyor.engine.core.config import EngineConfig
    from conveyor.engine.engine_factory import _in_setting_names

    config = EngineConfig(model="m", dtype="bfloat16", draft_model="m",
                          draft_weight_format="q4_1_int8")  # valid: it constructs
    assert config.draft_torch_dtype == config.draft_torch_kv_dtype == torch.float32
    same = EngineConfig(model="m", dtype="bfloat16", draft_model="m", draft_weight_format="fp32")
    assert same.draft_torch_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="CPU only") as error:
        EngineConfig(model="m", device="cuda", dtype="bfloat16", draft_model="m")
    assert "change CONVEYOR_ENGINE_SPECULATIVE_METHOD to ngram" in \
        _in_setting_names(str(error.value))


@pytest.mark.parametrize("weight_class", [Q4_1Weight, bw.Q4_1Int8Weight])
def test_the_block_kernels_release_the_gil(kernels, wakeups_during, weight_class) -> None:
    """The engine's asyncio/gRPC thread runs while a quantized linear does."""
    weights, x = weight_class(torch.randn(8192, 4096)), torch.randn(4, 4096)

    def calls():
        for _ in range(10):
            weights.matmul(x)

    during, elapsed = wakeups_during(calls)
    assert elapsed > 0.003, "the kernel ran too briefly to tell"
    assert during >= 3, f"{during} wake-ups in {elapsed * 1e3:.1f} ms of kernel calls"


def test_int8_formats_run_larger_steps_in_bf16_where_the_cpu_has_native_bf16() -> None:
    from conveyor.engine.native.cpu_features import CpuFeatures

    amx = CpuFeatures(avx2=True, avx512=True, avx512_vnni=True, avx512_bf16=True, amx=True)
    avx2 = CpuFeatures(avx2=True, avx512=False, avx512_vnni=False, avx512_bf16=False, amx=False)
    assert ql.large_step_dtype("q4_1_int8", amx, "auto") == torch.bfloat16
    assert ql.large_step_dtype("q8_0_int8", amx, "auto") == torch.bfloat16
    assert ql.large_step_dtype("q4_1_int8", avx2, "auto") == torch.float32
    assert ql.large_step_dtype("q4_1_int8", avx2, "bf16") == torch.bfloat16  # forced
    assert ql.large_step_dtype("q4_1_int8", amx, "fp32") == torch.float32
    for exact in ("q4_1", "q8_0", "fp16"):  # fp32 activations: fp32's results stay
        assert ql.large_step_dtype(exact, amx, "bf16") == torch.float32


@pytest.mark.parametrize("choice", ["bf16", "fp32"])
def test_an_int8_layer_runs_steps_past_its_rows_in_the_chosen_dtype(kernels, monkeypatch,
                                                                     choice) -> None:
    monkeypatch.setattr(ql, "INT8_PREFILL", choice)
    model = _Tiny()
    fp32_weight = model.proj.weight.detach().clone()
    quantize_linears(model, "q4_1_int8")
    layer = model.proj
    expected = torch.bfloat16 if choice == "bf16" else torch.float32
    assert layer.dense.weight.dtype == expected
    assert torch.equal(layer.dense.weight.float(), fp32_weight.to(expected).float())
    x = torch.randn(40, 64)  # past the 32 rows of the int8 kernel
    out = layer(x)
    assert out.dtype == torch.float32
    reference = x.to(expected).double() @ fp32_weight.to(expected).double().t()
    assert _relative_error(out, reference) < (1e-2 if choice == "bf16" else TOLERANCE)
    small = torch.randn(4, 64)  # the int8 kernel's rows are unchanged
    assert torch.equal(layer(small), layer.weights.matmul(small))


def test_an_int8_layer_adds_its_fp32_bias_when_its_larger_steps_are_bf16(kernels,
                                                                         monkeypatch) -> None:
    monkeypatch.setattr(ql, "INT8_PREFILL", "bf16")
    model = _Tiny()
    model.proj = CpuLinear.from_linear(nn.Linear(64, 64), pack=False)
    bias = model.proj.bias.detach().clone()
    quantize_linears(model, "q4_1_int8")
    layer = model.proj
    assert layer.dense.bias.dtype == torch.bfloat16 and layer.bias.dtype == torch.float32
    small = torch.randn(4, 64)
    assert torch.equal(layer(small), layer.weights.matmul(small) + bias)


def test_formats_with_fp32_activations_keep_fp32_for_larger_steps(kernels, monkeypatch) -> None:
    monkeypatch.setattr(ql, "INT8_PREFILL", "bf16")
    model = _Tiny()
    quantize_linears(model, "q4_1")
    assert model.proj.dense.weight.dtype == torch.float32
