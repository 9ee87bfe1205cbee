"""Root-mean-square layer norm (Llama), optionally fused with the residual add before it."""

from __future__ import annotations

import torch
from torch import nn

from conveyor.engine.model.fused_ops import add_rms_norm_, rms_norm


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and cast back (as transformers does); one C++
    pass on float32 and bfloat16 CPU tensors (fused_ops.py)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, residual: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """`residual += delta` (in place: the residual stream), then the norm of the sum."""
        return add_rms_norm_(residual, delta, self.weight, self.eps)
