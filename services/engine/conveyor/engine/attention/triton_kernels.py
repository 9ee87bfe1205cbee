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
    """One program per token: copy its Hkv * D key and value row into its slot.
    A negative slot (PADDING_SLOT, a CUDA graph's padding rows) writes nothing."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    offs = tl.arange(0, ROW_PAD)
    mask = offs < tl.where(slot >= 0, ROW, 0)
    key = tl.load(key_ptr + token * key_token_stride + offs, mask=mask)
    value = tl.load(value_ptr + token * value_token_stride + offs, mask=mask)
    tl.store(k_cache_ptr + slot * ROW + offs, key, mask=mask)
    tl.store(v_cache_ptr + slot * ROW + offs, value, mask=mask)


@triton.jit
def _first_tile(query_start_loc_ptr, request, BLOCK_Q: tl.constexpr):
    """Index of request's first query tile in the step's tile grid. Request b's tiles
    start at query_start_loc[b] // BLOCK_Q + b, which leaves room for its
    ceil(query_len / BLOCK_Q) tiles (a tile never spans two requests)."""
    start = tl.load(query_start_loc_ptr + request)
    if BLOCK_Q == 1:
        first = start
    else:
        first = start // BLOCK_Q + request
    return first


@triton.jit
def _find_request(query_start_loc_ptr, tile, num_requests, BLOCK_Q: tl.constexpr):
    """The request owning `tile`: binary search for the last first tile <= tile."""
    lo: tl.int32 = 0
    hi = num_requests
    while lo < hi:
        mid = (lo + hi) // 2
        if _first_tile(query_start_loc_ptr, mid, BLOCK_Q) <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def paged_attention_kernel(out_ptr, query_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
                           query_start_loc_ptr, seq_lens_ptr, num_requests,
                           query_token_stride, out_token_stride, block_table_stride,
                           scale, sliding_window,
                           USE_WINDOW: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                           GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                           HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
                           BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
                           DOT_IN_FP32: tl.constexpr):
    """One program per (query tile, kv head). A tile is BLOCK_Q consecutive query tokens
    of one request times the GROUP query heads sharing the kv head: BLOCK_M rows
    (row r = token r // GROUP, head r % GROUP). It walks the request's context BLOCK_N
    key positions at a time (block ids from the block table, so the prefix cached
    before this step and the chunk's own keys alike), with an online softmax; the
    mask is causal within the chunk (and the sliding window when USE_WINDOW).
    Decode steps run with BLOCK_Q = 1: one tile per token. DOT_IN_FP32 upcasts 16-bit
    operands before tl.dot (the CPU interpreter multiplies bfloat16 wrongly)."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    request = _find_request(query_start_loc_ptr, tile, num_requests, BLOCK_Q)
    query_start = tl.load(query_start_loc_ptr + request)
    query_len = tl.load(query_start_loc_ptr + request + 1) - query_start
    local_tile = tile - _first_tile(query_start_loc_ptr, request, BLOCK_Q)
    if local_tile * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + request)
    context_len = seq_len - query_len

    rows = tl.arange(0, BLOCK_M)
    query_index = local_tile * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (query_index < query_len)
    query_pos = context_len + query_index
    token = (query_start + query_index).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    q_mask = row_valid[:, None] & dim_valid[None, :]
    query = tl.load(query_ptr + token[:, None] * query_token_stride
                    + head[:, None] * HEAD_DIM + dims[None, :], mask=q_mask, other=0.0)
    if DOT_IN_FP32:
        query = query.to(tl.float32)

    last_pos = tl.minimum(seq_len - 1, context_len + (local_tile + 1) * BLOCK_Q - 1)
    if USE_WINDOW:
        first_pos = tl.maximum(context_len + local_tile * BLOCK_Q - sliding_window + 1, 0)
    else:
        first_pos = seq_len * 0
    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    table = block_tables_ptr + request.to(tl.int64) * block_table_stride
    for start in range((first_pos // BLOCK_N) * BLOCK_N, last_pos + 1, BLOCK_N):
        key_pos = start + tl.arange(0, BLOCK_N)
        key_valid = key_pos <= last_pos
        block = tl.load(table + key_pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        slots = block * BLOCK_SIZE + key_pos % BLOCK_SIZE
        kv_offs = (slots[:, None] * NUM_KV_HEADS + kv_head) * HEAD_DIM + dims[None, :]
        kv_mask = key_valid[:, None] & dim_valid[None, :]
        keys = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        values = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        if DOT_IN_FP32:
            keys, values = keys.to(tl.float32), values.to(tl.float32)
        scores = tl.dot(query, tl.trans(keys), input_precision=DOT_PRECISION) * scale
        allowed = key_valid[None, :] & (key_pos[None, :] <= query_pos[:, None])
        if USE_WINDOW:
            allowed = allowed & (key_pos[None, :] > query_pos[:, None] - sliding_window)
        scores = tl.where(allowed, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        # A row with nothing allowed yet (padding, or a window not reached) keeps max -inf:
        # subtract 0 instead, so its probabilities and correction are 0, not NaN.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.exp(scores - shift[:, None])
        correction = tl.exp(running_max - shift)
        running_sum = running_sum * correction + tl.sum(probs, axis=1)
        probs = probs.to(v_cache_ptr.dtype.element_ty)  # as the GPU's 16-bit dot rounds
        if DOT_IN_FP32:
            probs = probs.to(tl.float32)
        acc = acc * correction[:, None] + tl.dot(probs, values, input_precision=DOT_PRECISION)
        running_max = new_max
    out = acc / tl.where(running_sum == 0.0, 1.0, running_sum)[:, None]
    out_offs = token[:, None] * out_token_stride + head[:, None] * HEAD_DIM + dims[None, :]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=q_mask)
