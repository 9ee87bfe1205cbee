"""What one step adds to its requests' timing (request_timing.py) and to the step's
metrics (iteration_stats.py): first schedules, prefill chunks, token times and the
stats of the samples that finished. EngineCore.step calls these around the model's run.
"""

from __future__ import annotations

from conveyor.engine.core.request import Request
from conveyor.engine.core.scheduler_output import ScheduledRequest
from conveyor.engine.iteration_stats import FinishedRequestStats, IterationStats
from conveyor.engine.request_delta import RequestDelta
from conveyor.engine.request_timing import PrefillChunk


def mark_scheduled(scheduled: list[ScheduledRequest], in_step: dict[str, Request], now: float,
                   iteration: IterationStats) -> list[PrefillChunk]:
    """Note first schedules (queue time) and open this step's prefill chunks."""
    prefills = []
    for item in scheduled:
        timing = in_step[item.request_id].timing
        if timing.first_scheduled_time is None:
            timing.first_scheduled_time = now
            iteration.queue_time.append(now - timing.arrival_time)
        if _is_prefill(item):
            chunk = PrefillChunk(now, item.num_computed_tokens, len(item.token_ids))
            timing.prefill_chunks.append(chunk)
            prefills.append(chunk)
    return prefills


def end_chunks(chunks: list[PrefillChunk], now: float) -> None:
    for chunk in chunks:
        chunk.end_time = now


def record_delta(request: Request, delta: RequestDelta, now: float,
                 iteration: IterationStats) -> None:
    """Token times (first token, inter-token latency) and, when `delta` finishes the
    sample, its finish time and stats; the finished delta carries the timing."""
    timing = request.timing
    if delta.new_token_ids:
        iteration.num_generation_tokens += len(delta.new_token_ids)
        if timing.last_token_time is None:
            iteration.time_to_first_token.append(now - timing.arrival_time)
            iteration.num_prompt_tokens += delta.num_prompt_tokens
            timing.first_token_time = now
        else:
            iteration.inter_token_latency.append(now - timing.last_token_time)
        timing.last_token_time = now
    if delta.finished:
        timing.finish_time = now
        delta.timing = timing
        iteration.finished.append(_finished_stats(request, delta))


def _is_prefill(item: ScheduledRequest) -> bool:
    """True unless the step computes just the latest sampled token (a decode step)."""
    num_known = len(item.prompt_token_ids) + len(item.output_token_ids)
    return not item.output_token_ids or item.num_computed_tokens < num_known - 1


def _finished_stats(request: Request, delta: RequestDelta) -> FinishedRequestStats:
    """What the metrics keep of a finished sample (times 0 for phases it never reached)."""
    timing = request.timing
    scheduled = timing.first_scheduled_time or timing.finish_time
    first_token = timing.first_token_time or timing.finish_time
    return FinishedRequestStats(
        finish_reason=delta.finish_reason.value,
        e2e_latency=timing.finish_time - timing.arrival_time,
        queue_time=scheduled - timing.arrival_time, prefill_time=first_token - scheduled,
        decode_time=timing.finish_time - first_token, num_prompt_tokens=delta.num_prompt_tokens,
        num_generation_tokens=delta.num_output_tokens,
        max_tokens=request.sampling_params.max_tokens)
