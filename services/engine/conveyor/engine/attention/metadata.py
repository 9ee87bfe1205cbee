"""The per-step tensors every attention backend reads."""

from __future__ import annotations

from dataclasses import dataclass

import torch

PADDING_SLOT = -1
"""slot_mapping entry of a padding token (the rows a CUDA graph runs past the real
batch): the triton store skips it, so padding never writes the pool."""


@dataclass(slots=True)
class AttentionMetadata:
    """One step's batch layout, built once per step by the model runner.

    T tokens of B requests are flattened request by request (prefill chunks and
    decode tokens alike). Invariants: tokens of request b are
    `query_start_loc[b] : query_start_loc[b + 1]`, at positions
    `seq_lens[b] - query_len .. seq_lens[b] - 1`; every slot in `slot_mapping`
    belongs to a block listed in that request's `block_tables` row; rows of
    `block_tables` are padded (with block 0) past the request's blocks, and the
    padding is never read below `seq_lens`.
    """

    slot_mapping: torch.Tensor
    """[T] int64: KV slot each new token is written to."""
    positions: torch.Tensor
    """[T] int64: position of each token in its sequence."""
    token_request: torch.Tensor
    """[T] int64: batch row (request index) of each token."""
    query_start_loc: torch.Tensor
    """[B + 1] int64: cumulative query lengths."""
    seq_lens: torch.Tensor
    """[B] int64: context length of each request after this step."""
    block_tables: torch.Tensor
    """[B, W] int32, W >= ceil(max_seq_len / block_size)."""
    block_size: int
    max_query_len: int
    max_seq_len: int

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def num_requests(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
