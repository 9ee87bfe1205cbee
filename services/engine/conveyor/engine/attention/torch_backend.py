"""Paged attention in plain torch: the CPU path and the reference for the others.

Vectorized over the batch: each request's context is gathered from the pool
into a padded [B, S] grid (S = longest context in the step), queries into a
padded [B, L] grid (L = longest query in the step), and one masked
scaled_dot_product_attention call serves prefill chunks and decode tokens
together. Memory per layer is O(B * S * Hkv * D) for the gathered context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from conveyor.engine.attention.backend import AttentionSpec
from conveyor.engine.attention.metadata import AttentionMetadata


@dataclass(slots=True)
class TorchAttentionPlan:
    """Indices and mask shared by all layers of one step."""

    slot_mapping: torch.Tensor
    """[T] new tokens' slots."""
    context_slots: torch.Tensor
    """[B * S] slot of every (request, context position); padding is masked."""
    token_request: torch.Tensor
    """[T] batch row of each flat token."""
    token_column: torch.Tensor
    """[T] index of each flat token inside its request's query."""
    mask: torch.Tensor
    """[B, 1, L, S] True where a query may attend a context position."""
    num_requests: int
    max_query_len: int
    max_seq_len: int


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write key/value rows [T, Hkv, D] into the pool at `slot_mapping`."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def build_plan(meta: AttentionMetadata, sliding_window: int | None) -> TorchAttentionPlan:
    device = meta.seq_lens.device
    context_pos = torch.arange(meta.max_seq_len, device=device)
    blocks = meta.block_tables[:, context_pos // meta.block_size].long()
    context_slots = blocks * meta.block_size + context_pos % meta.block_size
    query_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
    first_query_pos = meta.seq_lens - query_lens
    query_pos = first_query_pos[:, None] + torch.arange(meta.max_query_len, device=device)
    mask = _attention_mask(context_pos, query_pos, meta.seq_lens, sliding_window)
    token_column = torch.arange(meta.num_tokens, device=device) - meta.query_start_loc[
        meta.token_request]
    return TorchAttentionPlan(
        slot_mapping=meta.slot_mapping, context_slots=context_slots.reshape(-1),
        token_request=meta.token_request, token_column=token_column,
        mask=mask.unsqueeze(1), num_requests=meta.num_requests,
        max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len)


def _attention_mask(context_pos: torch.Tensor, query_pos: torch.Tensor, seq_lens: torch.Tensor,
                    sliding_window: int | None) -> torch.Tensor:
    """[B, L, S]: causal within the request's context. A padding query row (past
    its request's query length) still sees position 0, so no row is all-False."""
    keys = context_pos[None, None, :]
    queries = query_pos[:, :, None]
    mask = (keys <= queries) & (keys < seq_lens[:, None, None])
    if sliding_window is not None:
        mask &= keys > queries - sliding_window
    return mask


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, plan: TorchAttentionPlan,
                    spec: AttentionSpec) -> torch.Tensor:
    """Attend query [T, H, D] over the context the plan gathers; returns [T, H, D]."""
    batch, length = plan.num_requests, plan.max_query_len
    padded_q = query.new_zeros(batch, length, spec.num_heads, spec.head_dim)
    padded_q[plan.token_request, plan.token_column] = query
    keys = _gather_context(kv_cache[0], plan, spec)
    values = _gather_context(kv_cache[1], plan, spec)
    out = F.scaled_dot_product_attention(
        padded_q.transpose(1, 2), keys, values, attn_mask=plan.mask, scale=spec.scale,
        enable_gqa=spec.num_queries_per_kv > 1)
    return out.transpose(1, 2)[plan.token_request, plan.token_column]


def _gather_context(cache: torch.Tensor, plan: TorchAttentionPlan,
                    spec: AttentionSpec) -> torch.Tensor:
    """[B, Hkv, S, D] context rows of one half (keys or values) of the pool."""
    rows = cache.view(-1, spec.num_kv_heads, spec.head_dim).index_select(0, plan.context_slots)
    return rows.view(plan.num_requests, plan.max_seq_len, spec.num_kv_heads,
                     spec.head_dim).transpose(1, 2)


class TorchAttentionBackend:
    """Backend `torch`: index_copy_ store plus one masked SDPA call per layer."""

    name = "torch"

    def __init__(self, spec: AttentionSpec) -> None:
        self.spec = spec

    def plan(self, meta: AttentionMetadata) -> TorchAttentionPlan:
        return build_plan(meta, self.spec.sliding_window)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, plan: TorchAttentionPlan) -> torch.Tensor:
        store_kv(key, value, kv_cache, plan.slot_mapping)
        return paged_attention(query, kv_cache, plan, self.spec)
