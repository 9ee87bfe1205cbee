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


def test_bfloat16_takes_the_torch_ops(native):
    x = torch.randn(3, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    cos, signed_sin = _angles(3)
    out = fused_ops.rotate_(x, cos, signed_sin)
    assert out.data_ptr() != x.data_ptr()
    assert torch.equal(out, fused_ops.rotate_torch(x, cos, signed_sin))
    norm = RMSNorm(HEAD_DIM, 1e-5)
    rows = x[:, 0]
    assert torch.equal(norm(rows), fused_ops.rms_norm_torch(rows, norm.weight, 1e-5))


def test_bad_input_is_a_clear_error(native):
    with pytest.raises(RuntimeError, match="residual and delta differ in shape"):
        native.add_rms_norm_(torch.zeros(2, 8), torch.zeros(3, 8), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="float32 CPU"):
        native.rms_norm(torch.zeros(2, 8, dtype=torch.float64), torch.ones(8), 1e-5)


def test_without_the_extension_the_torch_ops_run(monkeypatch):
    monkeypatch.setattr(fused_ops, "native_ops", lambda: None)
    residual, delta, weight = torch.randn(4, HIDDEN), torch.randn(4, HIDDEN), torch.randn(HIDDEN)
    expected = fused_ops.rms_norm_torch(residual + delta, weight, 1e-5)
    assert torch.equal(fused_ops.add_rms_norm_(residual, delta, weight, 1e-5), expected)
