"""The torch backend's per-step plan: requests split into a decode group and a
prefill group, each with its block gather indices and a boolean mask.

Splitting keeps a mixed step (decodes + prefill chunks) from padding every decode
token's query up to the longest chunk: decode rows attend as [Bd, H, 1, S], prefill
chunks as [Bp, H, L, S]. Context is gathered by whole blocks (one index per block),
so S is a multiple of the block size; the mask hides the padding. Everything here
is built once per step and shared by all layers. The per-request lengths are read
on the host (free on CPU; on CUDA this backend is only the tests' reference).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conveyor.engine.attention.metadata import AttentionMetadata


@dataclass(slots=True)
class AttentionGroup:
    """Requests attended in one SDPA call per layer."""

    token_index: torch.Tensor | None
    """[Tg] flat tokens of the group, or None when the group is every token in order."""
    query_index: torch.Tensor | None
    """[Tg] row * L + column of each token in the padded [B * L] query grid, or None
    when every row has exactly L tokens (no padding: the tokens are the grid)."""
    block_ids: torch.Tensor
    """[B * W] pool blocks to gather, W blocks per row (padding rows repeat block 0)."""
    mask: torch.Tensor | None
    """[B, 1, L, W * block_size], True where a query may attend; None when plain causal
    attention is exact (every row a first chunk of L tokens, no sliding window): SDPA then
    skips the masked half."""
    context_buffer: torch.Tensor | None
    """[2, B * W, block_size, Hkv, D] where the layers gather keys and values (reused by
    every layer of the step), set by the backend from its workspace."""
    num_rows: int
    query_len: int

    context_len: int
    """S = W * block_size."""

    @property
    def num_blocks(self) -> int:
        return self.block_ids.shape[0]


@dataclass(slots=True)
class TorchAttentionPlan:
    """The new tokens' slots and the groups (decode first) of one step."""

    slot_mapping: torch.Tensor
    groups: list[AttentionGroup]


def build_plan(meta: AttentionMetadata, sliding_window: int | None,
               with_decode: bool = True) -> TorchAttentionPlan:
    """The step's groups; with_decode=False leaves the decode rows out (a backend
    that attends them itself; the plan then has no group when every row decodes)."""
    starts, seq_lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    query_lens = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    decode_rows = [r for r, n in enumerate(query_lens) if n == 1] if with_decode else []
    prefill_rows = [r for r, n in enumerate(query_lens) if n > 1]
    groups = [_group(meta, rows, starts, query_lens, seq_lens, sliding_window,
                     whole_step=len(rows) == len(query_lens))
              for rows in (decode_rows, prefill_rows) if rows]
    return TorchAttentionPlan(slot_mapping=meta.slot_mapping, groups=groups)


def _group(meta: AttentionMetadata, rows: list[int], starts: list[int], query_lens: list[int],
           seq_lens: list[int], sliding_window: int | None, whole_step: bool) -> AttentionGroup:
    device = meta.seq_lens.device
    length = max(query_lens[r] for r in rows)
    uniform = all(query_lens[r] == length for r in rows)
    causal = uniform and sliding_window is None and all(seq_lens[r] == length for r in rows)
    row_index = torch.tensor(rows, device=device)
    width = -(-max(seq_lens[r] for r in rows) // meta.block_size)
    blocks = meta.block_tables.index_select(0, row_index)[:, :width].long()
    token_index = None if whole_step else torch.cat(
        [torch.arange(starts[r], starts[r + 1], device=device) for r in rows])
    query_index = None if uniform else torch.cat(
        [torch.arange(i * length, i * length + query_lens[r], device=device)
         for i, r in enumerate(rows)])
    mask = None if causal else _mask(meta, row_index, [query_lens[r] for r in rows], length,
                                     width * meta.block_size, sliding_window)
    return AttentionGroup(token_index=token_index, query_index=query_index,
                          block_ids=blocks.reshape(-1), mask=mask, context_buffer=None,
                          num_rows=len(rows), query_len=length,
                          context_len=width * meta.block_size)


def _mask(meta: AttentionMetadata, row_index: torch.Tensor, query_lens: list[int], length: int,
          context_len: int, sliding_window: int | None) -> torch.Tensor:
    """[B, 1, L, S] boolean mask of the group's rows (True: may attend). Boolean, not
    additive: SDPA's cuDNN kernel (CUDA, torch 2.11) misreads an fp32 additive mask under
    16-bit queries (NaN in float16, wrong values in bfloat16; tests/gpu/test_triton_vs_torch.py)."""
    device = row_index.device
    seq_lens = meta.seq_lens.index_select(0, row_index)
    first_query_pos = seq_lens - torch.tensor(query_lens, device=device)
    query_pos = first_query_pos[:, None] + torch.arange(length, device=device)
    context_pos = torch.arange(context_len, device=device)
    return _allowed(context_pos, query_pos, seq_lens, sliding_window).unsqueeze(1)


def _allowed(context_pos: torch.Tensor, query_pos: torch.Tensor, seq_lens: torch.Tensor,
             sliding_window: int | None) -> torch.Tensor:
    """[B, L, S]: causal within the request's context. A padding query row (past
    its request's query length) still sees position 0, so no row is all-masked."""
    keys = context_pos[None, None, :]
    queries = query_pos[:, :, None]
    allowed = (keys <= queries) & (keys < seq_lens[:, None, None])
    if sliding_window is not None:
        allowed &= keys > queries - sliding_window
    return allowed
