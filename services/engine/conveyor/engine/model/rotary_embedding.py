"""Rotary position embedding with optional linear or Llama-3 frequency scaling.

Uses the "rotate half" layout (first half of head_dim pairs with the second
half), which is how HF checkpoints store q/k weights.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from conveyor.engine.model.fused_ops import rotate_
from conveyor.engine.model.model_config import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """The head_dim // 2 rotation frequencies, scaled as the config asks."""
    # fp32 throughout, as transformers computes them, so angles agree bit for bit.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Long wavelengths divided by factor, short kept, a smooth blend between."""
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin of every position up to max_positions, precomputed in fp32.

    `lookup` runs once per step; `apply_rotary` once per layer on q and k together
    ([T, H + Hkv, D], in place where it can). Rotation runs in fp32 and casts back to
    the input dtype. The table holds, per position, [cos, cos, -sin, sin] (each D/2 wide), so a
    rotation is x * cos + swap_halves(x) * signed_sin: the same products and sums
    as x1 * cos - x2 * sin, x2 * cos + x1 * sin, bit for bit, in fewer ops.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: RopeScaling) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.theta = theta
        self.scaling = scaling
        self.register_buffer("cos_sin", torch.empty(max_positions, 2 * head_dim),
                             persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """(Re)compute the table in place, e.g. after construction on the meta device."""
        if self.cos_sin.is_meta:
            return
        inv_freq = inverse_frequencies(self.head_dim, self.theta, self.scaling)
        angles = torch.outer(torch.arange(self.max_positions, dtype=torch.float32), inv_freq)
        cos, sin = angles.cos(), angles.sin()
        table = torch.cat([cos, cos, -sin, sin], dim=-1)
        self.cos_sin = table.to(device=self.cos_sin.device)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin, each [T, 1, D]; positions must be < max_positions (the
        runner refuses a max_model_len beyond it, so no check here: it would sync)."""
        cos, signed_sin = self.cos_sin.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
        return cos, signed_sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate [T, H, D] by the looked-up angles (rotate-half layout): in place on float32 and
    bfloat16 CPU tensors (one C++ loop, fused_ops.py), else into a new tensor; returns the
    result."""
    return rotate_(x, cos, signed_sin)
