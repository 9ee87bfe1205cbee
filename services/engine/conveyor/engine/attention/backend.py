"""What an attention backend provides; implementations register in registry.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from conveyor.engine.attention.metadata import AttentionMetadata


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """The shape of one model's attention (the same for every layer)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None = None
    dtype: torch.dtype = torch.float32
    """The model's dtype: its queries', keys' and values' (a backend may pick kernels by it)."""

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads


class AttentionBackend(Protocol):
    """Paged attention over the KV pool layout documented in attention/__init__.py.

    `plan` runs once per step (outside the layers) and returns backend-private
    state derived from the metadata; `forward` runs once per layer. A plan is
    valid only for the step whose metadata built it.
    """

    spec: AttentionSpec

    def plan(self, meta: AttentionMetadata) -> Any: ...

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, plan: Any) -> torch.Tensor:
        """Write key/value [T, Hkv, D] at plan's slots, then attend query [T, H, D].

        Each token sees its request's cached context up to and including its own
        position (causal, and within the sliding window if any). Returns [T, H, D].
        """
        ...
