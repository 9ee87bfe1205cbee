"""A projection with LoRA adapters applied per row, several adapters in one step.

Each adapted projection keeps `max_loras` slots of adapter weights in two stacked
tensors at fixed addresses (`a` [slots x width, in], `b` [slots x width, out], width =
fused slices x max_rank; adapter.py's layout, zeros in a free slot). A step's rows are
told apart by the slot of their request (`LoraBatch`, -1 for the base model), and the
projection adds, for every row at once,

    y += ((x @ a[:n]^T) * mask) @ b[:n]      n = width x (highest slot in the step + 1)

where `mask[t, c]` is 1 when column c belongs to row t's slot. That is punica's BGMV
as two dense GEMMs and a multiply: a fixed number of ops whatever the mix of adapters
(a loop over adapters would cost ~4 small ops per adapter, layer and projection), at the
price of computing the columns of the other slots in the step and the padding past each
adapter's rank. A step without adapter rows costs nothing more than the base model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LoraBatch:
    """The step's rows by adapter slot, shared by every LoRA projection of the model; the
    model runner sets it before each forward pass."""

    def __init__(self, max_loras: int, max_rank: int) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.num_slots = 0
        """Slots the step reaches: its highest slot + 1 (0: no row has an adapter)."""
        self._token_slots: torch.Tensor | None = None
        self._masks: dict[int, torch.Tensor] = {}

    def set_step(self, token_slots: torch.Tensor | None, num_slots: int,
                 dtype: torch.dtype) -> None:
        """`token_slots` [T]: each row's slot, -1 for the base model; `num_slots` its
        highest slot + 1 (0, and None for the slots: no row has an adapter)."""
        self._masks.clear()
        self._dtype = dtype
        self._token_slots = token_slots
        self.num_slots = num_slots

    def mask(self, width: int) -> torch.Tensor:
        """[T, num_slots x width]: 1 where a column is in the row's slot (slot = column //
        width), made once per step and width."""
        mask = self._masks.get(width)
        if mask is None:
            column_slot = torch.arange(self.num_slots * width,
                                       device=self._token_slots.device) // width
            mask = (self._token_slots[:, None] == column_slot[None, :]).to(self._dtype)
            self._masks[width] = mask
        return mask


class LoraLinear(nn.Module):
    """`base` (any projection module) plus the adapters in its slots, as `LoraBatch` says."""

    def __init__(self, base: nn.Module, num_slices: int, in_features: int, out_features: int,
                 batch: LoraBatch, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.base = base
        self.batch = batch
        self.width = num_slices * batch.max_rank
        slots = batch.max_loras * self.width
        self.register_buffer("a", torch.zeros(slots, in_features, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("b", torch.zeros(slots, out_features, dtype=dtype, device=device),
                             persistent=False)

    def set_slot(self, slot: int, weights: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Put an adapter's (a, b) for this projection in `slot` (None: it leaves this
        projection alone, zeros)."""
        rows = slice(slot * self.width, (slot + 1) * self.width)
        if weights is None:
            self.a[rows].zero_()
            self.b[rows].zero_()
        else:
            self.a[rows].copy_(weights[0])
            self.b[rows].copy_(weights[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if not self.batch.num_slots:
            return y
        columns = self.batch.num_slots * self.width
        shrunk = F.linear(x, self.a[:columns]).mul_(self.batch.mask(self.width))
        return y.addmm_(shrunk.to(y.dtype), self.b[:columns].to(y.dtype))
