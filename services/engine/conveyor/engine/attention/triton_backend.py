"""Backend `triton`: the KV store and paged attention as Triton kernels.

The attention kernel runs one program per (token, kv head), so a step mixing
prefill chunks and decode tokens is one launch. For decode this is the usual
paged-decode shape; for long prefills it re-reads the context once per query
token (no query tiling), which is correct but not the fastest prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from conveyor.engine.attention.backend import AttentionSpec
from conveyor.engine.attention.metadata import AttentionMetadata
from conveyor.engine.attention.triton_kernels import paged_attention_kernel, store_kv_kernel


@dataclass(slots=True)
class TritonAttentionPlan:
    """The metadata tensors the kernels read, made contiguous once per step."""

    slot_mapping: torch.Tensor
    positions: torch.Tensor
    token_request: torch.Tensor
    block_tables: torch.Tensor
    block_size: int


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write key/value rows [T, Hkv, D] into the pool at `slot_mapping` (one program a token)."""
    key, value = _rows_contiguous(key), _rows_contiguous(value)
    row = key.shape[1] * key.shape[2]
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    store_kv_kernel[(num_tokens,)](
        key, value, kv_cache[0], kv_cache[1], slot_mapping,
        key.stride(0), value.stride(0), ROW=row, ROW_PAD=triton.next_power_of_2(row))


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, plan: TritonAttentionPlan,
                    spec: AttentionSpec) -> torch.Tensor:
    """Attend query [T, H, D] causally over each token's paged context; returns [T, H, D]."""
    query = _rows_contiguous(query)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_tokens = query.shape[0]
    if num_tokens == 0:
        return out
    group = spec.num_queries_per_kv
    paged_attention_kernel[(num_tokens, spec.num_kv_heads)](
        out, query, kv_cache[0], kv_cache[1], plan.block_tables, plan.token_request,
        plan.positions, query.stride(0), out.stride(0), plan.block_tables.stride(0),
        spec.scale, spec.sliding_window or 0, USE_WINDOW=spec.sliding_window is not None,
        NUM_KV_HEADS=spec.num_kv_heads, GROUP=group,
        GROUP_PAD=max(triton.next_power_of_2(group), 2), HEAD_DIM=spec.head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(spec.head_dim), BLOCK_SIZE=plan.block_size)
    return out


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """The kernels index [T, H, D] as token stride + h * D + d."""
    if x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.contiguous()


class TritonAttentionBackend:
    """Backend `triton` (GPU; on CPU only under TRITON_INTERPRET=1).

    Requires a power-of-two block size (tl.arange extents).
    """

    name = "triton"

    def __init__(self, spec: AttentionSpec) -> None:
        self.spec = spec

    def plan(self, meta: AttentionMetadata) -> TritonAttentionPlan:
        if meta.block_size & (meta.block_size - 1):
            raise ValueError(f"the triton backend needs a power-of-two block_size, "
                             f"got {meta.block_size}")
        return TritonAttentionPlan(
            slot_mapping=meta.slot_mapping.contiguous(), positions=meta.positions.contiguous(),
            token_request=meta.token_request.contiguous(),
            block_tables=meta.block_tables.contiguous(), block_size=meta.block_size)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, plan: TritonAttentionPlan) -> torch.Tensor:
        store_kv(key, value, kv_cache, plan.slot_mapping)
        return paged_attention(query, kv_cache, plan, self.spec)
