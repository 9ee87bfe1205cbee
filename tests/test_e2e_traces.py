"""One request, one trace across four real processes: the gateway, tokenizer, engine and
detok export over OTLP/gRPC to a receiver running in this test, and a chat completion's
spans all share one trace id, rooted at the gateway's request span, with the GenAI
attributes on the gateway's generation span and on the engine's."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from devkit.local_redis import delete_namespace, redis_url
from devkit.stack import Stack, StackSpec

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
SERVICES = ("conveyor-gateway", "conveyor-tokenizer", "conveyor-engine", "conveyor-detok")


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace endpoint that keeps every span it is sent."""

    def __init__(self):
        self.spans: list[ReceivedSpan] = []

    async def Export(self, request, context):
        for resource_spans in request.resource_spans:
            service = _attributes(resource_spans.resource.attributes).get("service.name", "")
            for scope_spans in resource_spans.scope_spans:
                self.spans.extend(
                    ReceivedSpan(service, span.name, span.trace_id.hex(), span.span_id.hex(),
                                 span.parent_span_id.hex(), _attributes(span.attributes))
                    for span in scope_spans.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


def _attributes(key_values) -> dict:
    return {kv.key: _value(kv.value) for kv in key_values}


def _value(any_value):
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(v) for v in any_value.array_value.values)
    return getattr(any_value, kind) if kind else None


@pytest.fixture
async def receiver():
    servicer = OtlpReceiver()
    server = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    servicer.port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield servicer
    await server.stop(grace=None)


def _otel_env(port: int) -> dict[str, str]:
    return {"HF_HUB_OFFLINE": "1", "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
            "OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_BSP_SCHEDULE_DELAY": "200"}


@pytest.fixture
async def traced_stack(receiver, tmp_path):
    """Tokenizer, engine, detok and gateway processes exporting to `receiver`."""
    spec = StackSpec(tmp_path, model=MODEL, env=_otel_env(receiver.port),
                     engine={"MAX_MODEL_LEN": "512", "KV_CACHE_GIB": "0.05", "TORCH_THREADS": "1"},
                     redis_url=redis_url(), redis_prefix=f"e2e-traces:{uuid.uuid4().hex[:12]}",
                     register_replicas=False)
    stack = Stack(spec)
    try:
        yield await asyncio.to_thread(stack.start)
    finally:
        await asyncio.to_thread(stack.stop)
        delete_namespace(spec.redis_url, spec.redis_prefix)


async def _wait_for_trace(receiver: OtlpReceiver, names: set[str],
                          timeout_s: float = 20.0) -> list[ReceivedSpan]:
    """The spans of the trace holding the gateway's generation span, once `names` are in."""
    deadline = time.monotonic() + timeout_s
    while True:
        generations = [s for s in receiver.spans if s.name == f"chat {MODEL}"]
        trace = [s for s in receiver.spans
                 if generations and s.trace_id == generations[0].trace_id]
        if names <= {s.name for s in trace} or time.monotonic() > deadline:
            return trace
        await asyncio.sleep(0.1)


async def test_one_chat_is_one_trace_across_the_four_services(traced_stack, receiver):
    async with httpx.AsyncClient(base_url=traced_stack.base_url,
                                 timeout=120) as client:
        response = await client.post("/v1/chat/completions", json={
            "model": MODEL, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "Name a color."}]})
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    trace = await _wait_for_trace(receiver, {
        f"chat {MODEL}", "POST /v1/chat/completions", "conveyor.v1.Tokenizer/Render",
        "conveyor.v1.Engine/Generate", "conveyor.v1.Detokenizer/Generate",
        f"text_completion {MODEL}", "queue", "prefill", "decode"})
    assert {s.service for s in trace} == set(SERVICES), sorted((s.service, s.name) for s in trace)

    by_id = {s.span_id: s for s in trace}
    [root] = [s for s in trace if not s.parent_id]
    assert (root.service, root.name) == ("conveyor-gateway", "POST /v1/chat/completions")
    assert all(_root_of(s, by_id) is root for s in trace)  # no orphans: one tree

    [gateway] = [s for s in trace if s.name == f"chat {MODEL}"]
    assert gateway.attributes.items() >= {
        "gen_ai.operation.name": "chat", "gen_ai.request.model": MODEL,
        "gen_ai.request.max_tokens": 4, "gen_ai.usage.input_tokens": usage["prompt_tokens"],
        "gen_ai.usage.output_tokens": usage["completion_tokens"],
        "gen_ai.response.finish_reasons": ("length",),
        "conveyor.request.id": response.headers["x-request-id"],
    }.items()
    [engine] = [s for s in trace if s.name == f"text_completion {MODEL}"]
    assert engine.service == "conveyor-engine"
    assert by_id[engine.parent_id].name == "conveyor.v1.Engine/Generate"
    # tokens flow one way: the gateway calls detok, whose call opens the engine's stream
    path = [(a.service, a.name) for a in _ancestors(engine, by_id)]
    assert path[:3] == [("conveyor-engine", "conveyor.v1.Engine/Generate"),
                        ("conveyor-detok", "conveyor.v1.Detokenizer/Generate"),
                        ("conveyor-gateway", "POST /v1/chat/completions")], path
    assert engine.attributes.items() >= {
        "gen_ai.operation.name": "text_completion", "gen_ai.request.model": MODEL,
        "gen_ai.request.max_tokens": 4, "gen_ai.usage.input_tokens": usage["prompt_tokens"],
        "gen_ai.usage.output_tokens": usage["completion_tokens"],
        "gen_ai.response.finish_reasons": ("length",),
    }.items()
    phases = sorted(s.name for s in trace if s.parent_id == engine.span_id)
    assert phases[0] == "decode" and phases[-1] == "queue" and "prefill" in phases


def _ancestors(span: ReceivedSpan, by_id: dict[str, ReceivedSpan]) -> list[ReceivedSpan]:
    """The spans above `span`, nearest first."""
    found = []
    while span.parent_id in by_id:
        span = by_id[span.parent_id]
        found.append(span)
    return found


def _root_of(span: ReceivedSpan, by_id: dict[str, ReceivedSpan]) -> ReceivedSpan | None:
    while span.parent_id:
        if span.parent_id not in by_id:
            return None
        span = by_id[span.parent_id]
    return span
