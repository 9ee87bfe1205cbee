"""The fused layer ops (model/fused_ops.py): the C++ loops against the torch ops they replace."""

from __future__ import annotations

import pytest
import torch

from conveyor.engine.model import fused_ops
from conveyor.engine.model.model_config import RopeScaling
from conveyor.engine.model.rms_norm import RMSNorm
from conveyor.engine.model.rotary_embedding import RotaryEmbedding

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 576, 9, 3, 64


@pytest.fixture(scope="module")
def native():
    module = fused_ops.native_ops()
    assert module is not None, "the fused ops did not build (see the log for why)"
    return module


def _angles(rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    table = RotaryEmbedding(HEAD_DIM, 4096, 10000.0, RopeScaling())
    positions = torch.randint(0, 4096, (rows,), generator=torch.Generator().manual_seed(seed))
    return table.lookup(positions)


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_add_rms_norm_adds_exactly_and_norms_within_rounding(native, rows):
    g = torch.Generator().manual_seed(rows)
    residual, delta = torch.randn(rows, HIDDEN, generator=g), torch.randn(rows, HIDDEN, generator=g)
    weight = torch.randn(HIDDEN, generator=g)
    expected_sum = residual + delta
    expected = fused_ops.rms_norm_torch(expected_sum, weight, 1e-5)
    out = fused_ops.add_rms_norm_(residual, delta, weight, 1e-5)
    assert torch.equal(residual, expected_sum)  # the residual stream, updated in place
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fused_ops.rms_norm(expected_sum, weight, 1e-5), expected,
                               rtol=1e-6, atol=1e-6)


def test_add_rms_norm_reads_strided_rows(native):
    wide = torch.randn(5, 2 * HIDDEN)
    delta = wide[:, :HIDDEN]  # rows HIDDEN apart in memory, as a split's halves are
    residual, weight = torch.randn(5, HIDDEN), torch.randn(HIDDEN)
    expected = fused_ops.rms_norm_torch(residual + delta, weight, 1e-5)
    torch.testing.assert_close(fused_ops.add_rms_norm_(residual, delta, weight, 1e-5),
                               expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 33])
def test_rotate_in_place_equals_torch_bit_for_bit(native, rows):
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    qk = qkv[:, :(HEADS + KV_HEADS) * HEAD_DIM].view(rows, HEADS + KV_HEADS, HEAD_DIM)
    v_before = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM:].clone()
    cos, signed_sin = _angles(rows)
    expected = fused_ops.rotate_torch(qk, cos, signed_sin)
    out = fused_ops.rotate_(qk, cos, signed_sin)
    assert out.data_ptr() == qk.data_ptr()
    assert torch.equal(out, expected)
    assert torch.equal(qkv[:, (HEADS + KV_HEADS) * HEAD_DIM:], v_before)  # v untouched


def within_one_bf16_ulp(out: torch.Tensor, expected: torch.Tensor) -> bool:
    """bf16 tensors equal, or apart by one unit in the last place where they differ (the fp32
    value before a rounding moved in its last bits), or both below 1e-30 (silu far below
    zero: torch's exp overflows to inf and gives -0, the own exp clamps and gives ~-1e-37)."""
    bits = (out.view(torch.int16).int() - expected.view(torch.int16).int()).abs()
    tiny = (out.float().abs() < 1e-30) & (expected.float().abs() < 1e-30)
    return out.dtype == expected.dtype == torch.bfloat16 and bool(((bits <= 1) | tiny).all())


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_bf16_add_rms_norm_adds_as_torch_and_norms_within_an_ulp(native, rows):
    g = torch.Generator().manual_seed(rows)
    residual, delta = (torch.randn(rows, HIDDEN, generator=g).bfloat16() for _ in range(2))
    weight = torch.randn(HIDDEN, generator=g).bfloat16()
    expected_sum = residual + delta
    expected = fused_ops.rms_norm_torch(expected_sum, weight, 1e-5)
    out = fused_ops.add_rms_norm_(residual, delta, weight, 1e-5)
    assert torch.equal(residual, expected_sum)  # bf16's add, bit for bit, in place
    assert within_one_bf16_ulp(out, expected)
    assert within_one_bf16_ulp(fused_ops.rms_norm(expected_sum, weight, 1e-5), expected)
    assert (out != expected).float().mean() < 0.01  # an ulp apart only now and then


@pytest.mark.parametrize("rows", [1, 33])
def test_bf16_rotate_in_place_equals_torch_bit_for_bit(native, rows):
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM).bfloat16()
    qk = qkv[:, :(HEADS + KV_HEADS) * HEAD_DIM].view(rows, HEADS + KV_HEADS, HEAD_DIM)
    qk[0, 0, :2] = torch.tensor([0.0, -0.0])
    cos, signed_sin = _angles(rows)
    expected = fused_ops.rotate_torch(qk, cos, signed_sin)
    out = fused_ops.rotate_(qk, cos, signed_sin)
    assert out.data_ptr() == qk.data_ptr()
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))  # signs of 0 too


def test_float16_takes_the_torch_ops(native):
    x = torch.randn(3, HEADS, HEAD_DIM, dtype=torch.float16)
    cos, signed_sin = _angles(3)
    out = fused_ops.rotate_(x, cos, signed_sin)
    assert out.data_ptr() != x.data_ptr()
    assert torch.equal(out, fused_ops.rotate_torch(x, cos, signed_sin))
    norm = RMSNorm(HEAD_DIM, 1e-5).half()
    rows = x[:, 0]
    assert torch.equal(norm(rows), fused_ops.rms_norm_torch(rows, norm.weight, 1e-5))


def test_bad_input_is_a_clear_error(native):
    with pytest.raises(RuntimeError, match="residual and delta differ in shape"):
        native.add_rms_norm_(torch.zeros(2, 8), torch.zeros(3, 8), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 CPU"):
        native.rms_norm(torch.zeros(2, 8, dtype=torch.float64), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="x and weight must have one dtype"):
        native.rms_norm(torch.zeros(2, 8, dtype=torch.bfloat16), torch.ones(8), 1e-5)


def test_without_the_extension_the_torch_ops_run(monkeypatch):
    monkeypatch.setattr(fused_ops, "native_ops", lambda: None)
    residual, delta, weight = torch.randn(4, HIDDEN), torch.randn(4, HIDDEN), torch.randn(HIDDEN)
    expected = fused_ops.rms_norm_torch(residual + delta, weight, 1e-5)
    assert torch.equal(fused_ops.add_rms_norm_(residual, delta, weight, 1e-5), expected)


INTERMEDIATE = 1536


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
@pytest.mark.parametrize("rows,width", [(1, INTERMEDIATE), (16, INTERMEDIATE), (257, 37)])
def test_silu_and_mul_is_within_1e_6_of_torch(native, monkeypatch, isa, rows, width):
    if isa == "avx512" and native.isa_name(0) != "avx512":
        pytest.skip("this CPU has no AVX-512")
    monkeypatch.setattr(fused_ops, "SWIGLU_ISA", fused_ops.SWIGLU_ISAS[isa])
    g = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * width, generator=g) * 4
    gate_up[0, :6] = torch.tensor([0.0, -0.0, 100.0, -100.0, 1e-30, -90.0])  # exp's range ends
    expected = fused_ops.silu_and_mul_torch(gate_up)
    out = fused_ops.silu_and_mul(gate_up)
    assert out.shape == (rows, width) and out.is_contiguous()
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-30)
    assert torch.equal(native.silu_and_mul(gate_up, fused_ops.SWIGLU_ISAS[isa]), out)


def test_silu_and_mul_reads_strided_rows(native):
    wide = torch.randn(5, 3 * INTERMEDIATE)
    gate_up = wide[:, :2 * INTERMEDIATE]  # rows 3I apart in memory
    torch.testing.assert_close(fused_ops.silu_and_mul(gate_up),
                               fused_ops.silu_and_mul_torch(gate_up), rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
@pytest.mark.parametrize("rows,width", [(1, INTERMEDIATE), (16, INTERMEDIATE), (257, 37)])
def test_bf16_silu_and_mul_is_within_an_ulp_of_torch(native, monkeypatch, isa, rows, width):
    """bf16: silu(gate) rounded to bf16, times up, rounded again, as torch's bf16 ops do; the
    own exp moves the fp32 silu in its last bits, so now and then a bf16 rounding by an ulp."""
    if isa == "avx512" and native.isa_name(0) != "avx512":
        pytest.skip("this CPU has no AVX-512")
    monkeypatch.setattr(fused_ops, "SWIGLU_ISA", fused_ops.SWIGLU_ISAS[isa])
    g = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * width, generator=g) * 4).bfloat16()
    gate_up[0, :6] = torch.tensor([0.0, -0.0, 100.0, -100.0, 1e-30, -90.0])
    expected = fused_ops.silu_and_mul_torch(gate_up)
    out = fused_ops.silu_and_mul(gate_up)
    assert out.shape == (rows, width) and out.is_contiguous()
    assert within_one_bf16_ulp(out, expected)
    assert (out != expected).float().mean() < 0.01


def test_silu_and_mul_falls_back_to_torch(native, monkeypatch):
    x = torch.randn(3, 2 * INTERMEDIATE, dtype=torch.float16)
    assert torch.equal(fused_ops.silu_and_mul(x), fused_ops.silu_and_mul_torch(x))
    x = torch.randn(3, 2 * INTERMEDIATE)
    monkeypatch.setattr(fused_ops, "SWIGLU_NATIVE", False)  # CONVEYOR_SWIGLU=off
    assert torch.equal(fused_ops.silu_and_mul(x), fused_ops.silu_and_mul_torch(x))
    with pytest.raises(RuntimeError, match="even width"):
        native.silu_and_mul(torch.zeros(2, 7), 0)


def test_kernels_release_the_gil(native, wakeups_during):
    """A thread that wakes every 0.2 ms runs while a kernel does (the engine's event loop
    and gRPC thread must not wait out a whole call); with the GIL held it could not."""
    gate_up, weight = torch.randn(4096, 2 * INTERMEDIATE), torch.ones(2 * INTERMEDIATE)

    def kernels():
        native.silu_and_mul(gate_up, 0)
        native.rms_norm(gate_up, weight, 1e-5)  # (no torch op in between: they release it)

    during, elapsed = wakeups_during(kernels)
    assert elapsed > 0.003, "the kernels ran too briefly to tell"
    assert during >= 3, f"{during} wake-ups in {elapsed * 1e3:.1f} ms of kernels"
