"""The engine's step observer: what one step adds to its requests' timing
(request_timing.py) and to the step's metrics (iteration_stats.py): first schedules,
preemptions, prefill chunks, token times, drafts and the stats of the samples that
finished. EngineCore.step tells it when a step is scheduled, executed and updated; at
the end of each step it hands the step's IterationStats to `on_iteration`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from conveyor.engine.core.request import Request
from conveyor.engine.core.scheduler_output import (
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from conveyor.engine.iteration_stats import FinishedRequestStats, IterationStats
from conveyor.engine.request_delta import RequestDelta
from conveyor.engine.request_timing import PrefillChunk

IterationSink = Callable[[IterationStats], None]


class StepTimer:
    """Times one step at a time; `on_iteration` (None: nobody) receives each step's stats."""

    def __init__(self, on_iteration: IterationSink | None = None):
        self.on_iteration = on_iteration
        self._iteration = IterationStats()
        self._in_step: dict[tuple[str, int], tuple[Request, ScheduledRequest]] = {}
        """(caller id, sample index) -> the request and its share of this step: the
        scheduler forgets those that finish in it."""
        self._prefills: list[PrefillChunk] = []

    def scheduled(self, batch: SchedulerOutput, requests: Mapping[str, Request]) -> None:
        """Note preemptions, first schedules (queue time) and open the prefill chunks."""
        now = time.monotonic()
        self._iteration = IterationStats()
        for request_id in batch.preempted_request_ids:
            if request_id in requests:
                requests[request_id].timing.preemption_times.append(now)
        self._in_step.clear()
        self._prefills = []
        for item in batch.scheduled:
            request = requests[item.request_id]
            self._in_step[request.caller_id, request.sample_index] = request, item
            timing = request.timing
            if timing.first_scheduled_time is None:
                timing.first_scheduled_time = now
                self._iteration.queue_time.append(now - timing.arrival_time)
            if _is_prefill(item):
                chunk = PrefillChunk(now, item.num_computed_tokens, len(item.token_ids))
                timing.prefill_chunks.append(chunk)
                self._prefills.append(chunk)

    def executed(self, batch: SchedulerOutput) -> None:
        """Close the prefill chunks; count the tokens run (a draft model fills its draft
        slots in the runner, so only now are they known)."""
        now = time.monotonic()
        for chunk in self._prefills:
            chunk.end_time = now
        self._iteration.num_scheduled_tokens = batch.num_batched_tokens

    def updated(self, deltas: list[RequestDelta], output: ModelRunnerOutput) -> None:
        """Token times, drafts and finishes of the step's deltas; hand the stats on."""
        now = time.monotonic()
        for delta in deltas:
            request, item = self._in_step[delta.request_id, delta.index]
            sampled = output.sampled.get(request.request_id, ())
            if item.draft_token_ids and sampled:
                self._iteration.record_drafts(len(item.draft_token_ids), len(sampled) - 1)
            self._record(request, delta, now)
        self._in_step.clear()
        if self.on_iteration is not None:
            self.on_iteration(self._iteration)

    def _record(self, request: Request, delta: RequestDelta, now: float) -> None:
        """Token times (first token, inter-token latency) and, when `delta` finishes the
        sample, its finish time and stats; the finished delta carries the timing."""
        timing, iteration = request.timing, self._iteration
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
