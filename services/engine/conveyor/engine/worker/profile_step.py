"""A synthetic largest step, for measuring peak memory before sizing the KV pool."""

from __future__ import annotations

import math
from dataclasses import dataclass

from conveyor.engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from conveyor.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class ProfilingStep:
    output: SchedulerOutput
    num_blocks: int
    """Blocks the step's requests use (ids 0 .. num_blocks - 1)."""


def profiling_step(max_num_batched_tokens: int, max_num_seqs: int, block_size: int,
                   max_model_len: int) -> ProfilingStep:
    """max_num_batched_tokens prompt tokens (at most max_model_len per request)
    spread over max_num_seqs requests (the first takes the remainder), every request
    sampling with top_p and top_k on, so the sampler's sort over [max_num_seqs,
    vocab] is counted too."""
    num_seqs = min(max_num_seqs, max_num_batched_tokens)
    num_tokens = min(max_num_batched_tokens, num_seqs * max_model_len)
    share = num_tokens // num_seqs
    lengths = [share] * num_seqs
    lengths[0] += num_tokens - share * num_seqs
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=1)
    scheduled, next_block = [], 0
    for i, length in enumerate(lengths):
        blocks = list(range(next_block, next_block + math.ceil(length / block_size)))
        next_block += len(blocks)
        slots = [blocks[p // block_size] * block_size + p % block_size for p in range(length)]
        scheduled.append(ScheduledRequest(
            request_id=f"profile-{i}", token_ids=[0] * length, num_computed_tokens=0,
            block_table=blocks, slot_mapping=slots, needs_sample=True, sampling_params=params,
            prompt_token_ids=[0] * length, output_token_ids=[]))
    return ProfilingStep(SchedulerOutput(scheduled=scheduled, block_size=block_size),
                         num_blocks=next_block)
