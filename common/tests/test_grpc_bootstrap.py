"""The shared gRPC bootstrap: health, reflection, trace propagation, drain."""

from __future__ import annotations

import asyncio
import gc

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from opentelemetry import trace

from conveyor.common.grpc_client import is_serving, open_channel
from conveyor.common.grpc_server import ServiceRegistration, start_grpc_server
from conveyor.common.log import request_id_var
from conveyor.common.settings import ServiceSettings
from conveyor.v1 import engine_pb2, engine_pb2_grpc, tokenizer_pb2, tokenizer_pb2_grpc

TOKENIZER = tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"].full_name
ENGINE = engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name


class _InfoOnly(tokenizer_pb2_grpc.TokenizerServicer):
    """A unit-test servicer that records the request id it saw."""

    seen_request_ids: list[str | None] = []

    async def Info(self, request, context):
        self.seen_request_ids.append(request_id_var.get())
        return tokenizer_pb2.TokenizerInfo(model="fake", vocab_size=7)


@pytest.fixture
async def service():
    registration = ServiceRegistration(
        TOKENIZER, tokenizer_pb2_grpc.add_TokenizerServicer_to_server, _InfoOnly()
    )
    service = await start_grpc_server(ServiceSettings(port=0), [registration])
    yield service
    await service.server.stop(grace=None)


async def test_health_reports_serving_then_not_serving_on_drain(service):
    channel = open_channel(f"127.0.0.1:{service.port}")
    assert await is_serving(channel, TOKENIZER)
    await service.set_serving(False)
    assert not await is_serving(channel, TOKENIZER)
    stub = health_pb2_grpc.HealthStub(channel)
    reply = await stub.Check(health_pb2.HealthCheckRequest(service=""))
    assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
    await channel.close()


async def test_reflection_lists_the_service(service):
    channel = open_channel(f"127.0.0.1:{service.port}")
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    call = stub.ServerReflectionInfo(iter([request]))
    async for reply in call:
        names = {s.name for s in reply.list_services_response.service}
        break
    assert TOKENIZER in names and "grpc.health.v1.Health" in names
    await channel.close()


async def test_server_span_is_child_of_callers_trace_context(service, span_exporter):
    span_exporter.clear()
    channel = open_channel(f"127.0.0.1:{service.port}")
    stub = tokenizer_pb2_grpc.TokenizerStub(channel)
    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("client-root") as root:
        request_id_var.set("req-42")
        info = await stub.Info(tokenizer_pb2.TokenizerInfoRequest())
    assert info.model == "fake"
    spans = span_exporter.get_finished_spans()
    server_spans = [s for s in spans if s.name.endswith("Tokenizer/Info")]
    assert len(server_spans) == 1
    span = server_spans[0]
    assert span.kind == trace.SpanKind.SERVER
    assert span.context.trace_id == root.get_span_context().trace_id
    assert span.parent.span_id == root.get_span_context().span_id
    assert _InfoOnly.seen_request_ids[-1] == "req-42"
    await channel.close()


async def test_drain_rejects_new_calls(service):
    channel = open_channel(f"127.0.0.1:{service.port}")
    stub = tokenizer_pb2_grpc.TokenizerStub(channel)
    await service.drain(timeout_s=0.5)
    with pytest.raises(grpc.aio.AioRpcError):
        await stub.Info(tokenizer_pb2.TokenizerInfoRequest(), timeout=2)
    await channel.close()


class _EndlessGenerate(engine_pb2_grpc.EngineServicer):
    """A unit-test servicer whose stream only ends when the client cancels it."""

    closed = asyncio.Event()

    async def Generate(self, request, context):
        try:
            while True:
                yield engine_pb2.GenerateResponse(token_ids=[1])
        finally:
            self.closed.set()


async def test_cancelled_stream_ends_its_span_cleanly(span_exporter, caplog):
    servicer = _EndlessGenerate()
    registration = ServiceRegistration(ENGINE, engine_pb2_grpc.add_EngineServicer_to_server,
                                       servicer)
    service = await start_grpc_server(ServiceSettings(port=0), [registration])
    channel = open_channel(f"127.0.0.1:{service.port}")
    call = engine_pb2_grpc.EngineStub(channel).Generate(engine_pb2.GenerateRequest())
    for _ in range(2):
        await call.read()
    call.cancel()
    await asyncio.wait_for(servicer.closed.wait(), 5)
    gc.collect()  # finalizes a handler generator the server abandoned at a yield
    await asyncio.sleep(0.1)
    spans = [s for s in span_exporter.get_finished_spans() if s.name.endswith("Engine/Generate")]
    assert len(spans) == 1
    assert "Failed to detach context" not in caplog.text
    await channel.close()
    await service.server.stop(grace=None)
