"""Triton kernels over the paged KV pool (layout in attention/__init__.py).

Set TRITON_INTERPRET=1 before this module is imported to run them on CPU
tensors (the tests do). `triton.jit` reads that variable at decoration time.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def store_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                    key_token_stride, value_token_stride,
                    ROW: tl.constexpr, ROW_PAD: tl.constexpr):
    """One program per token: copy its Hkv * D key and value row into its slot."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    offs = tl.arange(0, ROW_PAD)
    mask = offs < ROW
    key = tl.load(key_ptr + token * key_token_stride + offs, mask=mask)
    value = tl.load(value_ptr + token * value_token_stride + offs, mask=mask)
    tl.store(k_cache_ptr + slot * ROW + offs, key, mask=mask)
    tl.store(v_cache_ptr + slot * ROW + offs, value, mask=mask)


@triton.jit
def paged_attention_kernel(out_ptr, query_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
                           token_request_ptr, positions_ptr,
                           query_token_stride, out_token_stride, block_table_stride,
                           scale, sliding_window,
                           USE_WINDOW: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                           GROUP: tl.constexpr,
                           GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                           HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """One program per (token, kv head): the GROUP query heads sharing that kv head
    attend causally over the token's context, one KV block per loop iteration,
    with an online softmax. Decode tokens and prefill tokens are handled alike;
    sliding_window is read only when USE_WINDOW."""
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    request = tl.load(token_request_ptr + token).to(tl.int64)
    position = tl.load(positions_ptr + token)
    group = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    head_mask = (group < GROUP)[:, None] & (dims < HEAD_DIM)[None, :]
    q_offs = token * query_token_stride + (kv_head * GROUP + group)[:, None] * HEAD_DIM \
        + dims[None, :]
    query = tl.load(query_ptr + q_offs, mask=head_mask, other=0.0).to(tl.float32)

    if USE_WINDOW:
        first_pos = tl.maximum(position - sliding_window + 1, 0)
    else:
        first_pos = position * 0
    running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    offs_in_block = tl.arange(0, BLOCK_SIZE)
    for block_idx in range(first_pos // BLOCK_SIZE, position // BLOCK_SIZE + 1):
        block = tl.load(block_tables_ptr + request * block_table_stride + block_idx).to(tl.int64)
        key_pos = block_idx * BLOCK_SIZE + offs_in_block
        valid = (key_pos <= position) & (key_pos >= first_pos)
        slots = block * BLOCK_SIZE + offs_in_block
        kv_offs = (slots[:, None] * NUM_KV_HEADS + kv_head) * HEAD_DIM + dims[None, :]
        kv_mask = valid[:, None] & (dims < HEAD_DIM)[None, :]
        keys = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
        values = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.sum(query[:, None, :] * keys[None, :, :], axis=2) * scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        probs = tl.exp(scores - new_max[:, None])
        correction = tl.exp(running_max - new_max)
        running_sum = running_sum * correction + tl.sum(probs, axis=1)
        acc = acc * correction[:, None] + tl.sum(probs[:, :, None] * values[None, :, :], axis=1)
        running_max = new_max
    out = acc / running_sum[:, None]
    out_offs = token * out_token_stride + (kv_head * GROUP + group)[:, None] * HEAD_DIM \
        + dims[None, :]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=head_mask)
