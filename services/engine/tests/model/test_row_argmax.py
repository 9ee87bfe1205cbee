import pytest
import torch

from conveyor.engine.sampling.row_argmax import row_argmax


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_row_argmax_is_argmax_ties_and_nan_included(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 49152, generator=g).to(dtype)
    x[3, [5, 900, 40000]] = 100.0  # a tie: the first index wins
    x[4] = 0.0  # all equal
    x[5, 77] = float("nan")  # NaN counts as the largest
    x[6, -1] = float("inf")
    expected = x.argmax(dim=-1)
    got = row_argmax(x)
    assert got.dtype == torch.int64 and torch.equal(got, expected)
    assert got[3] == 5 and got[4] == 0 and got[5] == 77 and got[6] == 49151
