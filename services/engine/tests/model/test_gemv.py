"""The streaming GEMV (native/csrc/gemv.cpp). fp32: within 1e-5 of F.linear in fp64 on both code
paths. bf16: within bf16 rounding of F.linear in fp64 over the same bf16 values, on every path
(AVX512-BF16's vdpbf16ps, and the AVX-512 and AVX2 paths that widen bf16 to fp32; each skipped
only where the CPU lacks it). Odd sizes and bias included; bad input refused with a clear
message."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conveyor.engine.model.cpu_linear import GEMV_ISAS, gemv_ops

ops = gemv_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="the GEMV does not build here")
ISAS = ["avx2"] + (["avx512"] if ops is not None and ops.has_avx512() else [])
BF16_ISAS = ["avx2", "avx512", "avx512-bf16"]
"""bf16_linear's paths; each test skips the ones this CPU lacks (the CI machine may lack the
bf16 dot product, or AVX-512)."""


def bf16_code(isa: str) -> int:
    """The path's code for bf16_linear, skipping the test where this CPU lacks the path."""
    try:
        ops.bf16_isa_name(GEMV_ISAS[isa])
    except RuntimeError as exc:
        pytest.skip(str(exc))
    return GEMV_ISAS[isa]


def relative_error(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                   b: torch.Tensor | None) -> float:
    reference = F.linear(x.double(), w.double(), None if b is None else b.double())
    return float((out.double() - reference).abs().max() / reference.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 11, 16, 23])
@pytest.mark.parametrize(("out_features", "in_features"),
                         [(1, 1), (5, 17), (13, 31), (40, 96), (192, 576), (577, 1537)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_fp64_linear(isa: str, rows: int, out_features: int, in_features: int,
                             bias: bool) -> None:
    torch.manual_seed(rows * 1000 + out_features)
    x, w = torch.randn(rows, in_features), torch.randn(out_features, in_features) * 0.05
    b = torch.randn(out_features) if bias else None
    out = ops.fp32_linear(x, w, b, GEMV_ISAS[isa])
    assert out.shape == (rows, out_features) and out.dtype == torch.float32
    assert relative_error(out, x, w, b) < 1e-5


@pytest.mark.parametrize("isa", ISAS)
def test_leading_dims_threads_and_a_strided_input(isa: str) -> None:
    torch.manual_seed(0)
    w, b = torch.randn(300, 64), torch.randn(300)
    x = torch.randn(2, 1, 64)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out = ops.fp32_linear(x, w, b, GEMV_ISAS[isa])
            assert out.shape == (2, 1, 300)
            assert relative_error(out.view(2, 300), x.view(2, 64), w, b) < 1e-5
    finally:
        torch.set_num_threads(threads)
    strided = torch.randn(64, 3).t()  # [3, 64], not contiguous: copied first
    assert relative_error(ops.fp32_linear(strided, w, None, GEMV_ISAS[isa]), strided, w,
                          None) < 1e-5


@pytest.mark.parametrize("isa", BF16_ISAS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 11, 16, 23])
@pytest.mark.parametrize(("out_features", "in_features"),
                         [(1, 1), (5, 17), (13, 31), (40, 96), (192, 576), (577, 1537)])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_within_rounding_of_fp64_linear(isa: str, rows: int, out_features: int,
                                             in_features: int, bias: bool) -> None:
    """Sums in fp32, each output rounded once to bf16 (at most half an ulp: 2^-9 of the
    largest output), against fp64 over the same bf16 inputs."""
    code = bf16_code(isa)
    torch.manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features).bfloat16()
    w = (torch.randn(out_features, in_features) * 0.05).bfloat16()
    b = torch.randn(out_features).bfloat16() if bias else None
    out = ops.bf16_linear(x, w, b, code)
    assert out.shape == (rows, out_features) and out.dtype == torch.bfloat16
    assert relative_error(out, x, w, b) < 2 ** -8


@pytest.mark.parametrize("isa", BF16_ISAS)
def test_bf16_leading_dims_threads_and_a_strided_input(isa: str) -> None:
    code = bf16_code(isa)
    torch.manual_seed(0)
    w, b = torch.randn(300, 64).bfloat16(), torch.randn(300).bfloat16()
    x = torch.randn(2, 1, 64).bfloat16()
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out = ops.bf16_linear(x, w, b, code)
            assert out.shape == (2, 1, 300)
            assert relative_error(out.view(2, 300), x.view(2, 64), w, b) < 2 ** -8
    finally:
        torch.set_num_threads(threads)
    strided = torch.randn(64, 3).bfloat16().t()
    assert relative_error(ops.bf16_linear(strided, w, None, code), strided, w, None) < 2 ** -8


def test_bf16_paths_by_name() -> None:
    """auto takes the bf16 dot product where the CPU has it, else the widest FMA path; a
    forced path the CPU lacks is refused."""
    auto = ops.bf16_isa_name(0)
    assert auto in BF16_ISAS and ops.bf16_isa_name(GEMV_ISAS["avx2"]) == "avx2"
    if auto != "avx512-bf16":
        with pytest.raises(RuntimeError, match="lacks avx512bf16"):
            ops.bf16_isa_name(GEMV_ISAS["avx512-bf16"])
    with pytest.raises(RuntimeError, match="isa must be 0"):
        ops.bf16_linear(torch.randn(1, 8).bfloat16(), torch.randn(4, 8).bfloat16(), None, 4)


def test_empty_and_zero_width_inputs() -> None:
    w, b = torch.randn(6, 8), torch.randn(6)
    assert ops.fp32_linear(torch.randn(0, 8), w, b).shape == (0, 6)
    out = ops.fp32_linear(torch.randn(2, 0), torch.randn(6, 0), b)
    assert torch.equal(out, b.expand(2, 6))


@pytest.mark.parametrize(("x", "w", "b", "message"), [
    (torch.randn(2, 8, dtype=torch.float64), torch.randn(4, 8), None, "x must be .* fp32"),
    (torch.randn(2, 8), torch.randn(4, 8).half(), None, "weight must be a contiguous"),
    (torch.randn(2, 8), torch.randn(8, 4).t(), None, "weight must be a contiguous"),
    (torch.randn(2, 8), torch.randn(4, 9), None, "x has 8 features but the weight 9"),
    (torch.randn(2, 8), torch.randn(4, 8), torch.randn(5),
     "bias must be a contiguous fp32 \\[4\\]"),
])
def test_bad_input_is_refused(x, w, b, message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        ops.fp32_linear(x, w, b)


def test_bad_bf16_input_is_refused() -> None:
    w = torch.randn(4, 8).bfloat16()
    with pytest.raises(RuntimeError, match="x must be a .* bf16 tensor"):
        ops.bf16_linear(torch.randn(2, 8), w)
    with pytest.raises(RuntimeError, match="bias must be a contiguous bf16 \\[4\\]"):
        ops.bf16_linear(torch.randn(2, 8).bfloat16(), w, torch.randn(4))


def test_an_unknown_code_path_is_refused() -> None:
    with pytest.raises(RuntimeError, match="isa must be 0"):
        ops.fp32_linear(torch.randn(1, 8), torch.randn(4, 8), None, 3)
    assert ops.isa_name(GEMV_ISAS["avx2"]) == "avx2"
    if not ops.has_avx512():
        with pytest.raises(RuntimeError, match="lacks avx512f"):
            ops.isa_name(GEMV_ISAS["avx512"])
    else:
        assert ops.isa_name(0) == "avx512"


def test_the_gemv_releases_the_gil(wakeups_during) -> None:
    """The engine's asyncio/gRPC thread runs while a one-row linear streams its weight."""
    x, w = torch.randn(1, 4096), torch.randn(8192, 4096)

    def calls():
        for _ in range(5):
            ops.fp32_linear(x, w, None, 0)

    during, elapsed = wakeups_during(calls)
    assert elapsed > 0.003, "the GEMV ran too briefly to tell"
    assert during >= 3, f"{during} wake-ups in {elapsed * 1e3:.1f} ms of GEMV calls"
