"""A Render call that carries a traceparent gets a server span under it."""

from __future__ import annotations

from opentelemetry import trace

from conveyor.common.grpc_client import open_channel
from conveyor.common.grpc_server import start_grpc_server
from conveyor.tokenizer.server import registration
from conveyor.tokenizer.settings import TokenizerSettings
from conveyor.v1 import tokenizer_pb2, tokenizer_pb2_grpc


async def test_server_span_is_child_of_the_callers_context(service, span_exporter):
    server = await start_grpc_server(TokenizerSettings(port=0), [registration(service)])
    channel = open_channel(f"127.0.0.1:{server.port}")
    try:
        stub = tokenizer_pb2_grpc.TokenizerStub(channel)
        request = tokenizer_pb2.RenderRequest(
            messages=[tokenizer_pb2.ChatMessage(role="user", content="Hi")])
        with trace.get_tracer("test").start_as_current_span("gateway-request") as root:
            reply = await stub.Render(request)
        assert reply.num_tokens > 0
    finally:
        await channel.close()
        await server.server.stop(grace=None)
    spans = [s for s in span_exporter.get_finished_spans()  # this trace's: the exporter
             if s.name.endswith("Tokenizer/Render")  # holds the whole session's spans
             and s.context.trace_id == root.get_span_context().trace_id]
    assert len(spans) == 1
    assert spans[0].kind == trace.SpanKind.SERVER
    assert spans[0].context.trace_id == root.get_span_context().trace_id
    assert spans[0].parent.span_id == root.get_span_context().span_id
