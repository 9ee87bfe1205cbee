"""Paged attention in plain torch: the CPU path and the reference for the others.

Vectorized per group of requests (torch_plan.py): decode tokens in one SDPA call
as [Bd, H, 1, S], prefill chunks in another as a padded [Bp, H, L, S] grid. Each
group's context is gathered from the pool block by block into [B, Hkv, S, D];
the additive mask (built once per step) hides padding and the future. Memory per
layer is O(B * S * Hkv * D) for the gathered context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from conveyor.engine.attention.backend import AttentionSpec
from conveyor.engine.attention.metadata import AttentionMetadata
from conveyor.engine.attention.torch_plan import AttentionGroup, TorchAttentionPlan, build_plan

__all__ = ["TorchAttentionBackend", "TorchAttentionPlan", "paged_attention", "store_kv"]


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write key/value rows [T, Hkv, D] into the pool at `slot_mapping` (rounded to the
    pool's dtype where it is narrower: kv_cache_dtype float16)."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping,
                                                             key.to(kv_cache.dtype))
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping,
                                                             value.to(kv_cache.dtype))


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, plan: TorchAttentionPlan,
                    spec: AttentionSpec) -> torch.Tensor:
    """Attend query [T, H, D] over the context the plan gathers; returns [T, H, D]."""
    if len(plan.groups) == 1 and plan.groups[0].token_index is None:
        return _attend_group(query, kv_cache, plan.groups[0], spec)
    out = torch.empty_like(query)
    for group in plan.groups:
        out.index_copy_(0, group.token_index,
                        _attend_group(query.index_select(0, group.token_index), kv_cache,
                                      group, spec))
    return out


def _attend_group(query: torch.Tensor, kv_cache: torch.Tensor, group: AttentionGroup,
                  spec: AttentionSpec) -> torch.Tensor:
    """query [Tg, H, D] of the group's tokens -> [Tg, H, D]."""
    rows, length = group.num_rows, group.query_len
    if group.query_index is None:
        grid = query.view(rows, length, spec.num_heads, spec.head_dim)
    else:
        grid = query.new_zeros(rows * length, spec.num_heads, spec.head_dim)
        grid.index_copy_(0, group.query_index, query)
        grid = grid.view(rows, length, spec.num_heads, spec.head_dim)
    keys = _gather_context(kv_cache[0], group.context_buffer[0], group, spec).to(query.dtype)
    values = _gather_context(kv_cache[1], group.context_buffer[1], group, spec).to(query.dtype)
    out = F.scaled_dot_product_attention(
        grid.transpose(1, 2), keys, values, attn_mask=group.mask,
        is_causal=group.mask is None, scale=spec.scale,
        enable_gqa=spec.num_queries_per_kv > 1).transpose(1, 2)
    if group.query_index is None:
        return out.reshape(rows * length, spec.num_heads, spec.head_dim)
    return out.reshape(rows * length, spec.num_heads, spec.head_dim).index_select(
        0, group.query_index)


def _gather_context(cache: torch.Tensor, buffer: torch.Tensor, group: AttentionGroup,
                    spec: AttentionSpec) -> torch.Tensor:
    """[B, Hkv, S, D] context of one half (keys or values) of the pool, by whole blocks,
    copied into `buffer` [B * W, block_size, Hkv, D] (no allocation per layer; an fp16 pool
    under fp32 queries is widened after, into a new tensor)."""
    blocks = torch.index_select(cache, 0, group.block_ids, out=buffer)
    return blocks.view(group.num_rows, group.context_len, spec.num_kv_heads,
                       spec.head_dim).transpose(1, 2)


class TorchAttentionBackend:
    """Backend `torch`: index_copy_ store plus one masked SDPA call per group and layer."""

    name = "torch"

    def __init__(self, spec: AttentionSpec) -> None:
        self.spec = spec
        self._workspace: torch.Tensor | None = None
        """[2, blocks, block_size, Hkv, D] gather space, grown to the largest step seen."""

    def plan(self, meta: AttentionMetadata) -> TorchAttentionPlan:
        """The step's plan. Its gather buffers, bound at the first layer, are views of
        this backend's workspace: a plan is valid only until the next step runs."""
        return build_plan(meta, self.spec.sliding_window)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, plan: TorchAttentionPlan) -> torch.Tensor:
        store_kv(key, value, kv_cache, plan.slot_mapping)
        return self.attend(query, kv_cache, plan)

    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor,
               plan: TorchAttentionPlan) -> torch.Tensor:
        """Attention of the plan's tokens over the pool as it is (nothing stored); rows
        of `query` in no group of the plan are left undefined in the result."""
        if plan.groups[0].context_buffer is None:
            self._bind_workspace(plan, kv_cache)
        return paged_attention(query, kv_cache, plan, self.spec)

    def _bind_workspace(self, plan: TorchAttentionPlan, kv_cache: torch.Tensor) -> None:
        """Give each group its slice of the workspace, growing it to this step's need."""
        num_blocks = sum(g.num_blocks for g in plan.groups)
        ws = self._workspace
        if (ws is None or ws.shape[1] < num_blocks or ws.shape[2:] != kv_cache.shape[2:]
                or ws.dtype != kv_cache.dtype or ws.device != kv_cache.device):
            ws = kv_cache.new_empty((2, num_blocks, *kv_cache.shape[2:]))
            self._workspace = ws
        offset = 0
        for group in plan.groups:
            group.context_buffer = ws[:, offset:offset + group.num_blocks]
            offset += group.num_blocks
