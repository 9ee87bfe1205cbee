"""Inverse transform sampling: one uniform number a row picks that row's token."""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 256
"""Tokens a block: the cumulative weight is summed over blocks, then inside one."""


def draw(weights: torch.Tensor, reach: torch.Tensor) -> torch.Tensor:
    """weights [R, V] >= 0 (each row's softmax up to a factor), reach [R, 1] float64 in
    (0, 1] -> [R] int64: the first token whose cumulative weight reaches reach x the row's
    total. For reach uniform in (0, 1] that is token i with probability w_i / total, and
    never a token of weight 0.

    The cumulative weight is taken in two levels, so no [R, V] float64 copy is made (at
    64 x 49,152 that copy and its sum took 4-12 ms of a 22 ms sampler call): float32 sums
    of blocks of BLOCK tokens, summed on in float64, choose the block; the drawn block's
    own tokens, summed in float64, choose the token. A block's probability is right to a
    few float32 roundings of itself, a token's inside its block to float64's; a single
    float32 running sum over the vocabulary would instead round away tokens lighter than
    its last bit (6e-8)."""
    rows, vocab = weights.shape
    if vocab % BLOCK:
        weights = F.pad(weights, (0, BLOCK - vocab % BLOCK))  # weight 0: never drawn
    blocks = weights.view(rows, -1, BLOCK)
    block_cdf = blocks.sum(dim=-1).double().cumsum(dim=-1)
    target = reach * block_cdf[:, -1:]  # in (0, total]
    block = torch.searchsorted(block_cdf, target)  # the first block whose cdf reaches it
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp_(min=0)), 0.0)
    token_cdf = blocks[torch.arange(rows, device=weights.device), block[:, 0]].double().cumsum(-1)
    # target's place inside the block, on the scale of the block's float64 total
    inside = (target - before) / (block_cdf.gather(1, block) - before) * token_cdf[:, -1:]
    token = torch.searchsorted(token_cdf, torch.minimum(inside, token_cdf[:, -1:]))
    return (block * BLOCK + token)[:, 0]
