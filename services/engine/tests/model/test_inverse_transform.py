"""Inverse transform sampling against a float64 running sum over the whole vocabulary."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conveyor.engine.sampling.inverse_transform import BLOCK, draw


def reference(weights: torch.Tensor, reach: torch.Tensor) -> torch.Tensor:
    """The first token whose float64 cumulative weight reaches reach x the row's total."""
    cdf = np.cumsum(weights.double().numpy(), axis=-1)
    return torch.tensor([np.searchsorted(row, r * row[-1]) for row, r in
                         zip(cdf, reach[:, 0].numpy(), strict=True)])


@pytest.mark.parametrize("vocab", [BLOCK * 3, 1000, 49152])  # 1000: a padded last block
def test_draws_what_a_float64_running_sum_draws(vocab):
    generator = torch.Generator().manual_seed(0)
    weights = torch.rand(256, vocab, generator=generator) ** 8  # uneven, some near 0
    weights[:, ::7] = 0.0
    reach = 1 - torch.rand(256, 1, generator=generator, dtype=torch.float64)
    assert torch.equal(draw(weights, reach), reference(weights, reach))


def test_each_token_at_its_probability():
    """Evenly spaced reaches land on each token as often as its share of the weight."""
    weights = torch.tensor([0.0, 5.0, 0.0, 1.0, 2.5, 0.0, 0.5, 1.0] + [0.0] * 300)
    draws = 10_000
    reach = (torch.arange(draws, dtype=torch.float64)[:, None] + 0.5) / draws
    counts = torch.bincount(draw(weights.repeat(draws, 1), reach), minlength=len(weights))
    expected = weights / weights.sum() * draws
    assert torch.allclose(counts.double(), expected.double(), atol=1.0)


def test_never_a_token_of_weight_zero_even_at_the_ends():
    weights = torch.zeros(2, 3 * BLOCK)
    weights[:, BLOCK + 3] = 1.0  # the first token of weight > 0, in the second block
    weights[:, 2 * BLOCK - 1] = 1.0  # the last one, at the end of that block
    reach = torch.tensor([[2.0 ** -53], [1.0]], dtype=torch.float64)
    assert draw(weights, reach).tolist() == [BLOCK + 3, 2 * BLOCK - 1]


def test_a_token_lighter_than_float32_rounding_of_the_sum_keeps_its_share():
    """One token of weight 1 and 49,151 of 1e-9: a float32 running sum stays 1.0 past
    the first token, so no light token could be drawn; here they keep their 4.9e-5."""
    weights = torch.full((3, 49152), 1e-9)
    weights[:, 0] = 1.0
    reach = torch.tensor([[1.0], [1 - 2e-5], [0.5]], dtype=torch.float64)
    drawn = draw(weights, reach)
    assert drawn.tolist()[2] == 0 and drawn.tolist()[0] == 49151
    assert abs(drawn[1].item() - reference(weights, reach)[1].item()) <= BLOCK
