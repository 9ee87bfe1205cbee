"""Request timing kept by the engine core, and the spans made from it: queue, one prefill
per chunk, decode, preemption events, GenAI attributes, all under the Generate RPC span."""

from __future__ import annotations

import pytest
from opentelemetry import trace

from conveyor.common.grpc_client import open_channel
from conveyor.common.grpc_server import ServiceRegistration, start_grpc_server
from conveyor.common.settings import ServiceSettings
from conveyor.engine.async_engine import AsyncEngine
from conveyor.engine.engine_request import EngineRequest
from conveyor.engine.request_tracing import RequestSpans
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.servicer import SERVICE_NAME, EngineServicer
from conveyor.v1 import engine_pb2, engine_pb2_grpc


def _request(request_id, prompt, priority=0, **params):
    return EngineRequest(request_id, list(prompt), SamplingParams(temperature=0.0, **params),
                         priority=priority)


def _final(deltas, request_id):
    [final] = [d for d in deltas if d.request_id == request_id and d.finished]
    return final


def test_timing_has_one_chunk_per_prefill_step_then_decode(support):
    core = support.make_core(block_size=4, max_num_batched_tokens=4)
    core.add_request(_request("a", range(1, 11), max_tokens=3))
    deltas = support.run_to_completion(core)
    assert all(d.timing is None for d in deltas if not d.finished)
    timing = _final(deltas, "a").timing
    chunks = [(c.first_position, c.num_tokens) for c in timing.prefill_chunks]
    assert chunks == [(0, 4), (4, 4), (8, 2)]  # 10 prompt tokens under a 4-token budget
    assert timing.arrival_time <= timing.first_scheduled_time == timing.prefill_chunks[0].start_time
    assert all(c.start_time <= c.end_time for c in timing.prefill_chunks)
    assert timing.prefill_chunks[-1].end_time <= timing.first_token_time
    assert timing.first_token_time <= timing.last_token_time == timing.finish_time
    assert timing.preemption_times == []


def _run_with_a_preemption(support):
    """low2 is preempted (2 seats) when "high" arrives, then recomputed from scratch."""
    core = support.make_core(num_blocks=16, block_size=4, max_num_seqs=2, max_model_len=32,
                             enable_prefix_caching=False)  # a prefix hit would skip the recompute
    core.add_request(_request("low1", range(4), priority=1, max_tokens=6))
    core.add_request(_request("low2", range(4), priority=1, max_tokens=6))
    deltas = core.step()
    core.add_request(_request("high", range(50, 58), priority=0, max_tokens=2))
    return core, deltas + support.run_to_completion(core)


def test_a_preempted_request_records_when_and_recomputes_in_new_chunks(support):
    _, deltas = _run_with_a_preemption(support)
    timing = _final(deltas, "low2").timing
    assert timing.num_preemptions == 1
    first, *recompute = timing.prefill_chunks
    assert (first.first_position, first.num_tokens) == (0, 4)
    assert [(c.first_position, c.num_tokens) for c in recompute] == [(0, 5)]  # prompt + 1 output
    assert recompute[0].start_time > timing.preemption_times[0]
    assert _final(deltas, "low1").timing.num_preemptions == 0


def test_a_preemption_is_an_event_of_the_sample_span(support, span_exporter):
    core, deltas = _run_with_a_preemption(support)
    final = _final(deltas, "low2")
    with trace.get_tracer("test").start_as_current_span("rpc") as rpc:
        RequestSpans(_request("low2", range(4), priority=1, max_tokens=6), core.info).observe(final)
    spans = _spans_of_trace(span_exporter, rpc.get_span_context().trace_id)
    [sample] = [s for s in spans if s.name == "text_completion fake"]
    assert [e.name for e in sample.events] == ["preempted"]
    assert sample.attributes["conveyor.num_preemptions"] == 1
    assert sorted(s.name for s in spans if s.parent and s.parent.span_id == sample.context.span_id
                  ) == ["decode", "prefill", "prefill", "queue"]


@pytest.fixture
async def served(support):
    engine = AsyncEngine(support.make_core(block_size=4, max_num_batched_tokens=4)).start()
    registration = ServiceRegistration(
        SERVICE_NAME, engine_pb2_grpc.add_EngineServicer_to_server, EngineServicer(engine))
    service = await start_grpc_server(ServiceSettings(port=0), [registration])
    channel = open_channel(f"127.0.0.1:{service.port}")
    yield engine_pb2_grpc.EngineStub(channel)
    await channel.close()
    await service.server.stop(grace=None)
    engine.shutdown()


def _spans_of_trace(span_exporter, trace_id):
    return [s for s in span_exporter.get_finished_spans() if s.context.trace_id == trace_id]


async def test_generate_leaves_genai_spans_under_the_rpc_span(served, span_exporter):
    span_exporter.clear()
    request = engine_pb2.GenerateRequest(
        request_id="traced", prompt_token_ids=list(range(1, 11)), priority=3,
        sampling=engine_pb2.SamplingParams(temperature=0.0, max_tokens=3))
    [_ async for _ in served.Generate(request)]
    [rpc] = [s for s in span_exporter.get_finished_spans()
             if s.name == "conveyor.v1.Engine/Generate" and _has_child(span_exporter, s)]
    spans = {s.name: s for s in _spans_of_trace(span_exporter, rpc.context.trace_id)}
    sample = spans["text_completion fake"]
    assert sample.parent.span_id == rpc.context.span_id
    assert dict(sample.attributes) | {"gen_ai.response.finish_reasons": None} == {
        "gen_ai.operation.name": "text_completion", "gen_ai.request.model": "fake",
        "gen_ai.request.max_tokens": 3, "gen_ai.request.temperature": 0.0,
        "gen_ai.request.top_p": 1.0, "gen_ai.usage.input_tokens": 10,
        "gen_ai.usage.output_tokens": 3, "gen_ai.response.finish_reasons": None,
        "conveyor.request.id": "traced", "conveyor.request.priority": 3,
        "conveyor.engine.id": "test-engine", "conveyor.usage.cached_tokens": 0,
        "conveyor.sample.index": 0, "conveyor.num_preemptions": 0,
        "conveyor.num_prefill_chunks": 3,
    }
    assert tuple(sample.attributes["gen_ai.response.finish_reasons"]) == ("length",)
    children = [s for s in _spans_of_trace(span_exporter, rpc.context.trace_id)
                if s.parent is not None and s.parent.span_id == sample.context.span_id]
    assert [s.name for s in sorted(children, key=lambda s: s.start_time)] == [
        "queue", "prefill", "prefill", "prefill", "decode"]
    prefills = [s for s in children if s.name == "prefill"]
    assert sorted(s.attributes["conveyor.prefill.num_tokens"] for s in prefills) == [2, 4, 4]
    assert rpc.start_time <= sample.start_time <= sample.end_time <= rpc.end_time


def _has_child(span_exporter, span) -> bool:
    return any(s.parent is not None and s.parent.span_id == span.context.span_id
               and s.name.startswith("text_completion") for s in span_exporter.get_finished_spans())


def test_nothing_is_recorded_without_a_recording_parent(support, span_exporter):
    core = support.make_core()
    core.add_request(_request("untraced", [1, 2, 3], max_tokens=2))
    final = _final(support.run_to_completion(core), "untraced")
    before = len(span_exporter.get_finished_spans())
    RequestSpans(_request("untraced", [1, 2, 3], max_tokens=2), core.info,
                 parent=trace.set_span_in_context(trace.INVALID_SPAN)).observe(final)
    assert len(span_exporter.get_finished_spans()) == before
