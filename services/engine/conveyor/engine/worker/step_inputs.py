"""Flattening a SchedulerOutput into the tensors of one forward pass.

Buffers are allocated once at the largest step (max_num_batched_tokens,
max_num_seqs, max_model_len) and each step fills a prefix of them: host
buffers are numpy views of (pinned, on CUDA) torch tensors; on CUDA the
prefix is copied into persistent device buffers, on CPU the host buffer is
used directly. Returned tensors are views: valid until the next `build`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from conveyor.engine.attention import AttentionMetadata
from conveyor.engine.core.scheduler_output import ScheduledRequest, SchedulerOutput


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    """[T] token ids of every scheduled token, request by request."""
    positions: torch.Tensor
    """[T]"""
    meta: AttentionMetadata
    sample_indices: torch.Tensor
    """[N] flat index of the last token of each request that needs a sample."""
    sample_requests: list[ScheduledRequest]
    """The N requests, in the order of sample_indices."""


class _Buffer:
    """A host buffer and, on CUDA, its device twin; `fill` returns the device prefix."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        on_cuda = device.type == "cuda"
        self.host = torch.zeros(shape, dtype=dtype, pin_memory=on_cuda)
        self.np = self.host.numpy()
        self.device = torch.zeros(shape, dtype=dtype, device=device) if on_cuda else self.host

    def prefix(self, *sizes: int) -> torch.Tensor:
        index = tuple(slice(0, n) for n in sizes)
        if self.device is not self.host:
            self.device[index].copy_(self.host[index], non_blocking=True)
        return self.device[index]


class StepInputBuilder:
    """Turns a SchedulerOutput into StepInputs, reusing its buffers every step."""

    def __init__(self, *, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                 block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = math.ceil(max_model_len / block_size)
        tokens, seqs = max_num_batched_tokens, max_num_seqs
        self._input_ids = _Buffer((tokens,), torch.int64, device)
        self._positions = _Buffer((tokens,), torch.int64, device)
        self._slot_mapping = _Buffer((tokens,), torch.int64, device)
        self._token_request = _Buffer((tokens,), torch.int64, device)
        self._query_start_loc = _Buffer((seqs + 1,), torch.int64, device)
        self._seq_lens = _Buffer((seqs,), torch.int64, device)
        self._sample_indices = _Buffer((seqs,), torch.int64, device)
        self._block_tables = _Buffer((seqs, self.max_blocks_per_seq), torch.int32, device)

    def build(self, output: SchedulerOutput) -> StepInputs:
        requests = output.scheduled
        self._check_fits(output)
        query_lens = np.fromiter((len(r.token_ids) for r in requests), np.int64, len(requests))
        computed = np.fromiter((r.num_computed_tokens for r in requests), np.int64, len(requests))
        num_tokens, num_reqs = int(query_lens.sum()), len(requests)
        starts = self._fill_offsets(query_lens, computed)
        self._fill_tokens(requests, num_tokens)
        max_seq_len = int((computed + query_lens).max())
        width = math.ceil(max_seq_len / self.block_size)
        if width > self.max_blocks_per_seq:
            raise ValueError(f"a sequence of {max_seq_len} tokens exceeds max_model_len="
                             f"{self.max_blocks_per_seq * self.block_size}")
        self._fill_block_tables(requests, width)
        sampled = [i for i, r in enumerate(requests) if r.needs_sample]
        self._sample_indices.np[:len(sampled)] = starts[1:][sampled] - 1
        meta = AttentionMetadata(
            slot_mapping=self._slot_mapping.prefix(num_tokens),
            positions=self._positions.prefix(num_tokens),
            token_request=self._token_request.prefix(num_tokens),
            query_start_loc=self._query_start_loc.prefix(num_reqs + 1),
            seq_lens=self._seq_lens.prefix(num_reqs),
            block_tables=self._block_tables.prefix(num_reqs, width),
            block_size=self.block_size, max_query_len=int(query_lens.max()),
            max_seq_len=max_seq_len)
        return StepInputs(
            input_ids=self._input_ids.prefix(num_tokens), positions=meta.positions, meta=meta,
            sample_indices=self._sample_indices.prefix(len(sampled)),
            sample_requests=[requests[i] for i in sampled])

    def _check_fits(self, output: SchedulerOutput) -> None:
        if output.block_size != self.block_size:
            raise ValueError(f"scheduler block_size {output.block_size} != runner block_size "
                             f"{self.block_size}; configure both the same")
        if len(output.scheduled) > self.max_num_seqs:
            raise ValueError(f"{len(output.scheduled)} requests in one step exceed "
                             f"max_num_seqs={self.max_num_seqs}")
        if output.num_batched_tokens > self.max_num_batched_tokens:
            raise ValueError(f"{output.num_batched_tokens} tokens in one step exceed "
                             f"max_num_batched_tokens={self.max_num_batched_tokens}")

    def _fill_offsets(self, query_lens: np.ndarray, computed: np.ndarray) -> np.ndarray:
        """Query start locations, sequence lengths, and per-token request and position."""
        num_reqs, num_tokens = len(query_lens), int(query_lens.sum())
        starts = self._query_start_loc.np[:num_reqs + 1]
        starts[0] = 0
        np.cumsum(query_lens, out=starts[1:])
        self._seq_lens.np[:num_reqs] = computed + query_lens
        owner = np.repeat(np.arange(num_reqs), query_lens)
        self._token_request.np[:num_tokens] = owner
        self._positions.np[:num_tokens] = np.arange(num_tokens) - starts[owner] + computed[owner]
        return starts

    def _fill_tokens(self, requests: list[ScheduledRequest], num_tokens: int) -> None:
        self._input_ids.np[:num_tokens] = np.fromiter(
            chain.from_iterable(r.token_ids for r in requests), np.int64, num_tokens)
        self._slot_mapping.np[:num_tokens] = np.fromiter(
            chain.from_iterable(r.slot_mapping for r in requests), np.int64, num_tokens)

    def _fill_block_tables(self, requests: list[ScheduledRequest], width: int) -> None:
        """Row i: the first `width` blocks of request i, zero-padded (never read)."""
        tables = self._block_tables.np
        for row, r in enumerate(requests):
            blocks = r.block_table[:width]
            tables[row, :len(blocks)] = blocks
            tables[row, len(blocks):width] = 0
