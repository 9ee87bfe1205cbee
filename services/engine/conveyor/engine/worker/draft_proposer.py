"""Drafts from a draft model: a cheaper copy of the model (another weight format) or a small
model sharing its tokenizer, run greedily for the steps the scheduler left draft slots in.

The draft model keeps its own KV pool under the target's block tables (the same slots, so
the scheduler's blocks serve both), and fills it only for requests it drafts for: each
request's draft KV is computed up to `_num_computed[request]`, and its first pass of a step
catches up from there (a prompt, or the tokens of steps it did not draft in) to the last
known token. Pass i (0 .. k-1) writes the KV of the token it reads and proposes the next;
the drafts are the argmax chain, a point-mass proposal, so the sampler's verification
keeps the target's distribution (sampling/sampler.py).
"""

from __future__ import annotations

import dataclasses

import torch

from conveyor.engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from conveyor.engine.model.llama import LlamaForCausalLM
from conveyor.engine.sampling.row_argmax import row_argmax
from conveyor.engine.worker.step_inputs import StepInputBuilder


class DraftModelProposer:
    """Fills `draft_token_ids` (and the matching `token_ids` and `slot_mapping`) of the
    scheduled requests that have `num_draft_slots`, before the target's pass."""

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[torch.Tensor],
                 builder: StepInputBuilder) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.builder = builder
        self.backend = model.model.layers[0].self_attn.backend
        self._num_computed: dict[str, int] = {}
        """Request id -> positions whose draft KV holds its tokens."""

    @torch.inference_mode()
    def fill(self, output: SchedulerOutput) -> None:
        # Keep the requests of this step only (not finished, preempted or waiting ones: a
        # count is worth one catch-up pass, and an id may come back as a new request), each
        # capped at the target's computed tokens: past them the draft KV may hold drafts
        # that were rejected, in a step that drafted or in any later one.
        self._num_computed = {
            r.request_id: min(self._num_computed[r.request_id], r.num_computed_tokens)
            for r in output.scheduled if r.request_id in self._num_computed}
        drafting = [r for r in output.scheduled if r.num_draft_slots and not r.draft_token_ids]
        if not drafting:
            return
        known = [len(r.token_ids) for r in drafting]  # the last known token is the last
        passes = [self._catch_up(r, output.block_size) for r in drafting]
        drafts: list[list[int]] = [[] for _ in drafting]
        for step in range(max(r.num_draft_slots for r in drafting)):
            live = [i for i, r in enumerate(drafting) if step < r.num_draft_slots]
            tokens = self._argmax(SchedulerOutput([passes[i] for i in live],
                                                  block_size=output.block_size))
            for i, token in zip(live, tokens, strict=True):
                drafts[i].append(token)
                passes[i] = _next_pass(passes[i], token, output.block_size)
        for r, n, d in zip(drafting, known, drafts, strict=True):
            position = r.num_computed_tokens + n - 1  # of the last known token
            self._num_computed[r.request_id] = position + len(d)  # passes wrote up to here
            r.draft_token_ids = d
            r.token_ids = r.token_ids + d
            r.slot_mapping = r.slot_mapping[:n + len(d)]

    def _catch_up(self, r: ScheduledRequest, block_size: int) -> ScheduledRequest:
        """Pass 0 of a request: its tokens from where its draft KV ends to its last known."""
        end = r.num_computed_tokens + len(r.token_ids)
        start = self._num_computed.get(r.request_id, 0)
        tokens = (r.prompt_token_ids + r.output_token_ids)[start:end]
        return dataclasses.replace(
            r, token_ids=tokens, num_computed_tokens=start, draft_token_ids=[],
            num_draft_slots=0, slot_mapping=_slots(r.block_table, start, end, block_size))

    def _argmax(self, output: SchedulerOutput) -> list[int]:
        inputs = self.builder.build(output)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches,
                            self.backend.plan(inputs.meta))
        logits = self.model.compute_logits(hidden.index_select(0, inputs.sample_indices))
        tokens = row_argmax(logits).tolist()
        self.builder.fence.mark_complete()
        return tokens


def _next_pass(r: ScheduledRequest, token: int, block_size: int) -> ScheduledRequest:
    position = r.num_computed_tokens + len(r.token_ids)
    return dataclasses.replace(r, token_ids=[token], num_computed_tokens=position,
                               slot_mapping=_slots(r.block_table, position, position + 1,
                                                   block_size))


def _slots(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    return [block_table[p // block_size] * block_size + p % block_size
            for p in range(start, end)]
