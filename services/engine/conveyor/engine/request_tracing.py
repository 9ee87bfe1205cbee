"""Trace spans of one Generate call's samples, cut from the timing the engine loop kept.

The loop thread creates no spans: it only stamps times (RequestTiming). When a
sample's final delta reaches the caller's coroutine, `RequestSpans.observe` makes
its spans after the fact, with explicit start and end times, under the context
the call started in (the RPC's server span):

    text_completion <model>    arrival -> finish; GenAI attributes; a "preempted" event each time
      queue                    arrival -> first scheduled
      prefill                  one per prefill chunk (recompute chunks after a preemption too)
      decode                   first token -> finish

Per token nothing happens here; per sample, a handful of spans at its end. A
sample whose stream was cancelled before it finished gets no spans (its RPC span
still shows the call). Nothing is recorded when the parent span is not recording.
"""

from __future__ import annotations

import time

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context

from conveyor.engine.engine_info import EngineInfo
from conveyor.engine.engine_request import EngineRequest
from conveyor.engine.request_delta import RequestDelta
from conveyor.engine.request_timing import PrefillChunk, RequestTiming

OPERATION = "text_completion"
"""gen_ai.operation.name of the engine's work: it completes token sequences."""

_tracer = trace.get_tracer("conveyor.engine")


class RequestSpans:
    """Spans for the samples of one request, parented to the context current at creation."""

    def __init__(self, request: EngineRequest, info: EngineInfo, parent: Context | None = None):
        self._parent = parent if parent is not None else otel_context.get_current()
        self._recording = trace.get_current_span(self._parent).is_recording()
        self._attributes = _request_attributes(request, info)
        self._model = info.model

    def observe(self, delta: RequestDelta) -> None:
        """Record a sample's spans once its final delta (the one with timing) arrives."""
        if delta.timing is not None and self._recording:
            self._record_sample(delta, delta.timing, _Clock())

    def _record_sample(self, delta: RequestDelta, timing: RequestTiming, clock: _Clock) -> None:
        sample = _tracer.start_span(f"{OPERATION} {self._model}", context=self._parent,
                                    start_time=clock.ns(timing.arrival_time))
        sample.set_attributes({**self._attributes, **_usage_attributes(delta, timing)})
        for preempted_at in timing.preemption_times:
            sample.add_event("preempted", timestamp=clock.ns(preempted_at))
        inside = trace.set_span_in_context(sample, self._parent)
        if timing.first_scheduled_time is not None:
            _child("queue", inside, clock, timing.arrival_time, timing.first_scheduled_time)
        for index, chunk in enumerate(timing.prefill_chunks):
            _prefill_span(inside, clock, index, chunk)
        if timing.first_token_time is not None and timing.finish_time is not None:
            _child("decode", inside, clock, timing.first_token_time, timing.finish_time,
                   {"gen_ai.usage.output_tokens": delta.num_output_tokens})
        sample.end(end_time=clock.ns(timing.finish_time or timing.arrival_time))


class _Clock:
    """Converts loop-thread `time.monotonic()` seconds into the epoch nanoseconds spans use."""

    def __init__(self):
        self._offset_ns = time.time_ns() - time.monotonic_ns()

    def ns(self, monotonic_s: float) -> int:
        return self._offset_ns + round(monotonic_s * 1e9)


def _child(name: str, parent: Context, clock: _Clock, start: float, end: float,
           attributes: dict | None = None) -> None:
    span = _tracer.start_span(name, context=parent, start_time=clock.ns(start),
                              attributes=attributes)
    span.end(end_time=clock.ns(end))


def _prefill_span(parent: Context, clock: _Clock, index: int, chunk: PrefillChunk) -> None:
    _child("prefill", parent, clock, chunk.start_time, chunk.end_time or chunk.start_time, {
        "conveyor.prefill.chunk_index": index,
        "conveyor.prefill.first_position": chunk.first_position,
        "conveyor.prefill.num_tokens": chunk.num_tokens,
    })


def _request_attributes(request: EngineRequest, info: EngineInfo) -> dict:
    params = request.sampling_params
    return {
        "gen_ai.operation.name": OPERATION,
        "gen_ai.request.model": info.model,
        "gen_ai.request.max_tokens": params.max_tokens,
        "gen_ai.request.temperature": params.temperature,
        "gen_ai.request.top_p": params.top_p,
        "conveyor.request.id": request.request_id,
        "conveyor.request.priority": request.priority,
        "conveyor.engine.id": info.engine_id,
    }


def _usage_attributes(delta: RequestDelta, timing: RequestTiming) -> dict:
    reason = delta.finish_reason.value if delta.finish_reason is not None else "unknown"
    return {
        "gen_ai.usage.input_tokens": delta.num_prompt_tokens,
        "gen_ai.usage.output_tokens": delta.num_output_tokens,
        "gen_ai.response.finish_reasons": [reason],
        "conveyor.usage.cached_tokens": delta.num_cached_tokens,
        "conveyor.sample.index": delta.index,
        "conveyor.num_preemptions": timing.num_preemptions,
        "conveyor.num_prefill_chunks": len(timing.prefill_chunks),
    }
