"""Logprobs of prompt tokens (vLLM's prompt_logprobs), from a step's hidden states.

The hidden state at position p gives the distribution of the token at p + 1, so a step
that computes prompt positions p .. q of a request yields the logprobs of its prompt
tokens p + 1 .. min(q + 1, len(prompt) - 1): over the steps of a chunked prefill, every
prompt token after the first, once. A request that already has output (resumed on this
engine, or recomputing after a preemption) gets none: its caller has them or never
asked. The scheduler's prefix cache never serves such a request (kv_cache_manager.py),
so every one of its prompt positions is computed here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from conveyor.engine.core.scheduler_output import (
    PromptTokenLogprob,
    ScheduledRequest,
    SchedulerOutput,
)

ROWS_PER_PASS = 256
"""Positions projected to the vocabulary at a time (bounds the [rows, vocab] logits)."""

ProjectToVocab = Callable[[torch.Tensor], torch.Tensor]
"""Rows of hidden states [R, hidden] to their logits [R, vocab] (the model's compute_logits)."""


def prompt_logprobs(output: SchedulerOutput, hidden: torch.Tensor,
                    project: ProjectToVocab) -> dict[str, list[PromptTokenLogprob]]:
    """By request id, the prompt logprobs of the positions this step computed, for the
    requests that asked for them; `hidden` is the step's [T, hidden] states."""
    found: dict[str, list[PromptTokenLogprob]] = {}
    start = 0
    for item in output.scheduled:
        num_rows = _num_prompt_rows(item)
        if num_rows:
            first_target = item.num_computed_tokens + 1
            targets = item.prompt_token_ids[first_target:first_target + num_rows]
            found[item.request_id] = _logprobs_of(
                hidden[start:start + num_rows], targets, project,
                item.sampling_params.prompt_logprobs)
        start += len(item.token_ids)
    return found


def _num_prompt_rows(item: ScheduledRequest) -> int:
    """How many of the step's rows of `item` predict a prompt token (0: none asked)."""
    if item.sampling_params.prompt_logprobs is None or item.output_token_ids:
        return 0
    last_source = len(item.prompt_token_ids) - 2  # the position that predicts the last one
    return max(0, min(len(item.token_ids), last_source - item.num_computed_tokens + 1))


def _logprobs_of(rows: torch.Tensor, targets: list[int], project: ProjectToVocab,
                 num_top: int) -> list[PromptTokenLogprob]:
    found: list[PromptTokenLogprob] = []
    target_ids = torch.tensor(targets, dtype=torch.int64, device=rows.device)
    for begin in range(0, len(targets), ROWS_PER_PASS):
        end = begin + ROWS_PER_PASS
        logprobs = project(rows[begin:end]).float().log_softmax(dim=-1)
        chosen = logprobs.gather(1, target_ids[begin:end, None])
        columns = [chosen, (logprobs > chosen).sum(dim=-1, keepdim=True) + 1]
        if num_top:
            top_values, top_ids = logprobs.topk(num_top, dim=-1)
            columns += [top_ids, top_values]
        table = torch.cat([c.double() for c in columns], dim=1).tolist()  # one host read
        found += [_entry(row, num_top) for row in table]
    return found


def _entry(row: list[float], num_top: int) -> PromptTokenLogprob:
    """row: logprob, rank, num_top ids, num_top values."""
    ids, values = row[2:2 + num_top], row[2 + num_top:]
    return PromptTokenLogprob(row[0], int(row[1]),
                              [(int(i), v) for i, v in zip(ids, values, strict=True)])
