"""Flattening a SchedulerOutput into the tensors of one forward pass.

Buffers are allocated once at the largest step (max_num_batched_tokens,
max_num_seqs, max_model_len) and each step fills a prefix of them in place
(staged_buffer.py): host buffers are numpy views of (pinned, on CUDA) torch
tensors; on CUDA the prefix is copied into persistent device buffers at fixed
addresses, on CPU the host buffer is used directly. A decode step replayed from
a CUDA graph is padded up to the graph's batch size (`pad_to`): the graph reads
the same device buffers. Returned tensors are views: valid until the next `build`.
The design, and what a persistent batch adds, is in docs/architecture.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from conveyor.engine.attention import AttentionMetadata
from conveyor.engine.attention.metadata import PADDING_SLOT
from conveyor.engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from conveyor.engine.worker.staged_buffer import CopyFence, StagedBuffer


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    """[T] token ids of every scheduled token, request by request."""
    positions: torch.Tensor
    """[T]"""
    meta: AttentionMetadata
    sample_indices: torch.Tensor
    """[R] flat index of each row sampled: per request that needs a sample, its last known
    token, then each of its drafts (speculative decoding), in order."""
    sample_requests: list[ScheduledRequest]
    """The requests that need a sample, in the order of sample_indices (request i has
    `num_sample_rows` consecutive rows)."""


class StepInputBuilder:
    """Turns a SchedulerOutput into StepInputs, reusing its buffers every step.

    Invariant: host buffers are written only after `fence` says the previous step's
    copies from them have run (`build` waits on it first).
    """

    def __init__(self, *, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                 block_size: int, device: torch.device, fence: CopyFence | None = None) -> None:
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = math.ceil(max_model_len / block_size)
        self.fence = fence or CopyFence(device)
        tokens, seqs = max_num_batched_tokens, max_num_seqs
        self._input_ids = StagedBuffer((tokens,), torch.int64, device)
        self._positions = StagedBuffer((tokens,), torch.int64, device)
        self._slot_mapping = StagedBuffer((tokens,), torch.int64, device)
        self._token_request = StagedBuffer((tokens,), torch.int64, device)
        self._query_start_loc = StagedBuffer((seqs + 1,), torch.int64, device)
        self._seq_lens = StagedBuffer((seqs,), torch.int64, device)
        self._sample_indices = StagedBuffer((tokens,), torch.int64, device)
        self._block_tables = StagedBuffer((seqs, self.max_blocks_per_seq), torch.int32, device)

    def build(self, output: SchedulerOutput, pad_to: int | None = None) -> StepInputs:
        """The step's inputs; with `pad_to` (a decode step of at most that many requests,
        one token each) padded with PADDING_SLOT rows up to `pad_to` requests."""
        requests = output.scheduled
        self._check_fits(output)
        self.fence.wait()
        query_lens = np.fromiter((len(r.token_ids) for r in requests), np.int64, len(requests))
        computed = np.fromiter((r.num_computed_tokens for r in requests), np.int64, len(requests))
        num_tokens, num_reqs = int(query_lens.sum()), len(requests)
        starts = self._fill_offsets(query_lens, computed)
        self._fill_tokens(requests, num_tokens)
        max_seq_len = int((computed + query_lens).max(initial=1))
        width = self._fill_block_tables(requests, max_seq_len)
        num_rows = self._fill_sample_indices(requests, starts)
        if pad_to is not None:
            self._fill_padding(num_reqs, num_tokens, pad_to)
            num_tokens = num_reqs = pad_to
        meta = self._metadata(num_tokens, num_reqs, width, int(query_lens.max(initial=1)),
                              max_seq_len)
        inputs = StepInputs(
            input_ids=self._input_ids.prefix(num_tokens), positions=meta.positions, meta=meta,
            sample_indices=self._sample_indices.prefix(num_rows),
            sample_requests=[r for r in requests if r.needs_sample])
        self.fence.record()
        return inputs

    def _metadata(self, num_tokens: int, num_reqs: int, width: int, max_query_len: int,
                  max_seq_len: int) -> AttentionMetadata:
        """Device views of the filled prefixes (copied up first on CUDA)."""
        return AttentionMetadata(
            slot_mapping=self._slot_mapping.prefix(num_tokens),
            positions=self._positions.prefix(num_tokens),
            token_request=self._token_request.prefix(num_tokens),
            query_start_loc=self._query_start_loc.prefix(num_reqs + 1),
            seq_lens=self._seq_lens.prefix(num_reqs),
            block_tables=self._block_tables.prefix(num_reqs, width),
            block_size=self.block_size, max_query_len=max_query_len, max_seq_len=max_seq_len)

    def padding_inputs(self, size: int) -> StepInputs:
        """A decode step of `size` padding rows (what a CUDA graph is captured on): the
        same device buffers as `build(..., pad_to=size)`, nothing written to the pool."""
        return self.build(SchedulerOutput(block_size=self.block_size), pad_to=size)

    def _fill_padding(self, num_reqs: int, num_tokens: int, pad_to: int) -> None:
        """Rows num_reqs..pad_to - 1: one token each at position 0 of a one-token context
        in block 0 (read, never written: the slot is PADDING_SLOT)."""
        if not num_reqs <= pad_to <= min(self.max_num_seqs, self.max_num_batched_tokens):
            raise ValueError(f"cannot pad {num_reqs} requests to {pad_to} (max_num_seqs="
                             f"{self.max_num_seqs}, max_num_batched_tokens="
                             f"{self.max_num_batched_tokens})")
        if num_tokens != num_reqs:
            raise ValueError("only a decode step (one token per request) can be padded")
        pad = slice(num_reqs, pad_to)
        self._input_ids.np[pad] = 0
        self._positions.np[pad] = 0
        self._slot_mapping.np[pad] = PADDING_SLOT
        self._token_request.np[pad] = np.arange(num_reqs, pad_to)
        self._query_start_loc.np[num_reqs:pad_to + 1] = np.arange(num_reqs, pad_to + 1)
        self._seq_lens.np[pad] = 1
        self._block_tables.np[pad, 0] = 0

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

    def _fill_sample_indices(self, requests: list[ScheduledRequest],
                             starts: np.ndarray) -> int:
        """Request i's m = num_sample_rows rows are its last m tokens: indices
        starts[i + 1] - m .. starts[i + 1] - 1. Returns the number of rows."""
        rows = np.fromiter((r.num_sample_rows for r in requests), np.int64, len(requests))
        num_rows = int(rows.sum())
        first_row = np.repeat(np.cumsum(rows) - rows, rows)
        self._sample_indices.np[:num_rows] = (np.repeat(starts[1:] - rows, rows)
                                              + np.arange(num_rows) - first_row)
        return num_rows

    def _fill_tokens(self, requests: list[ScheduledRequest], num_tokens: int) -> None:
        self._input_ids.np[:num_tokens] = np.fromiter(
            chain.from_iterable(r.token_ids for r in requests), np.int64, num_tokens)
        self._slot_mapping.np[:num_tokens] = np.fromiter(
            chain.from_iterable(r.slot_mapping for r in requests), np.int64, num_tokens)

    def _fill_block_tables(self, requests: list[ScheduledRequest], max_seq_len: int) -> int:
        """Row i: the first `width` blocks of request i, zero-padded (never read), width
        the blocks of the longest sequence; returns width."""
        width = math.ceil(max_seq_len / self.block_size)
        if width > self.max_blocks_per_seq:
            raise ValueError(f"a sequence of {max_seq_len} tokens exceeds max_model_len="
                             f"{self.max_blocks_per_seq * self.block_size}")
        tables = self._block_tables.np
        for row, r in enumerate(requests):
            blocks = r.block_table[:width]
            tables[row, :len(blocks)] = blocks
            tables[row, len(blocks):width] = 0
        return width
