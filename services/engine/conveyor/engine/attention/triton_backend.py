"""Backend `triton`: the KV store and tiled paged attention as Triton kernels.

One attention launch per layer covers the whole step: the grid is (query tiles,
kv heads), a tile being up to BLOCK_Q query tokens of one request (decode tokens
and prefill chunks alike) against that request's paged context (triton_kernels.py).
Decode-only steps use one-token tiles; steps with a prefill chunk use wide tiles, so
a chunk reads its context once per tile instead of once per token.

The plan reads nothing back from the device (the grid follows from tensor shapes and
the metadata's host-side max_query_len), so a step plans without a synchronisation
and a decode step can be captured in a CUDA graph (worker/cuda_graphs.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from conveyor.engine.attention.backend import AttentionSpec
from conveyor.engine.attention.metadata import AttentionMetadata
from conveyor.engine.attention.triton_kernels import paged_attention_kernel, store_kv_kernel

MIN_DOT = 16
"""tl.dot needs every extent >= 16."""
FP32_BLOCK_N = 32
"""Key tile cap in fp32: the pipelined K/V tiles take twice the shared memory of 16-bit ones."""


@dataclass(frozen=True, slots=True)
class TileShape:
    """Query rows per program (BLOCK_M = BLOCK_Q tokens x GROUP heads, padded) and key
    positions per loop iteration (BLOCK_N)."""

    block_m: int
    block_q: int
    block_n: int


def tile_shape(group: int, max_query_len: int) -> TileShape:
    """Decode-only steps: one token per tile, 64 keys an iteration (bandwidth-bound).
    Otherwise 64 query rows (at least one token's heads) against 32 keys."""
    if max_query_len == 1:
        return TileShape(max(MIN_DOT, triton.next_power_of_2(group)), 1, 64)
    block_m = max(64, triton.next_power_of_2(group))
    return TileShape(block_m, block_m // group, 32)


def num_tiles(num_tokens: int, num_requests: int, block_q: int) -> int:
    """Programs along the grid's first axis: request b's tiles start at
    query_start_loc[b] // block_q + b (one tile per token when block_q is 1); programs
    past a request's last tile return at once."""
    return num_tokens if block_q == 1 else num_tokens // block_q + num_requests


@dataclass(slots=True)
class TritonAttentionPlan:
    """The metadata tensors the kernels read (rows contiguous) and the step's tiles."""

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    block_size: int
    tiles: TileShape


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write key/value rows [T, Hkv, D] into the pool at `slot_mapping` (one program a
    token); tokens whose slot is negative (metadata.PADDING_SLOT) are skipped."""
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
    num_tokens, num_requests = query.shape[0], plan.seq_lens.shape[0]
    if num_tokens == 0:
        return out
    tiles = plan.tiles
    block_n = tiles.block_n if query.element_size() < 4 else min(tiles.block_n, FP32_BLOCK_N)
    grid = (num_tiles(num_tokens, num_requests, tiles.block_q), spec.num_kv_heads)
    paged_attention_kernel[grid](
        out, query, kv_cache[0], kv_cache[1], plan.block_tables, plan.query_start_loc,
        plan.seq_lens, num_requests, query.stride(0), out.stride(0),
        plan.block_tables.stride(0), spec.scale, spec.sliding_window or 0,
        USE_WINDOW=spec.sliding_window is not None, NUM_KV_HEADS=spec.num_kv_heads,
        GROUP=spec.num_queries_per_kv, HEAD_DIM=spec.head_dim,
        HEAD_DIM_PAD=max(MIN_DOT, triton.next_power_of_2(spec.head_dim)),
        BLOCK_SIZE=plan.block_size, BLOCK_M=tiles.block_m, BLOCK_Q=tiles.block_q,
        BLOCK_N=block_n,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        DOT_IN_FP32=query.device.type == "cpu")
    return out


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """The kernels index [T, H, D] as token stride + h * D + d."""
    if x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.contiguous()


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """Vectors and tables are indexed by their first stride only (block tables may be a
    column prefix of a wider buffer: no copy needed)."""
    return x if x.stride(-1) == 1 else x.contiguous()


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
            slot_mapping=_last_dim_contiguous(meta.slot_mapping),
            query_start_loc=_last_dim_contiguous(meta.query_start_loc),
            seq_lens=_last_dim_contiguous(meta.seq_lens),
            block_tables=_last_dim_contiguous(meta.block_tables), block_size=meta.block_size,
            tiles=tile_shape(self.spec.num_queries_per_kv, meta.max_query_len))

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, plan: TritonAttentionPlan) -> torch.Tensor:
        store_kv(key, value, kv_cache, plan.slot_mapping)
        return paged_attention(query, kv_cache, plan, self.spec)
