"""A Detokenize call that carries a traceparent gets a server span under it."""

from __future__ import annotations

from opentelemetry import trace

from conveyor.common.grpc_client import open_channel
from conveyor.common.grpc_server import start_grpc_server
from conveyor.detok.server import registration
from conveyor.detok.settings import DetokSettings
from conveyor.v1 import detok_pb2, detok_pb2_grpc


async def test_server_span_is_child_of_the_callers_context(tokenizer, span_exporter):
    service = await start_grpc_server(DetokSettings(port=0), [registration(tokenizer)])
    channel = open_channel(f"127.0.0.1:{service.port}")
    try:
        stub = detok_pb2_grpc.DetokenizerStub(channel)
        messages = [detok_pb2.DetokenizeRequest(
            start=detok_pb2.DetokenizeStart(), token_ids=[19556], finish=True)]
        with trace.get_tracer("test").start_as_current_span("gateway-request") as root:
            replies = [r async for r in stub.Detokenize(iter(messages))]
        assert replies[0].text_delta == "Hello"
    finally:
        await channel.close()
        await service.server.stop(grace=None)
    spans = [s for s in span_exporter.get_finished_spans()  # this trace's: the exporter
             if s.name.endswith("Detokenize")  # holds the whole session's spans
             and s.context.trace_id == root.get_span_context().trace_id]
    assert len(spans) == 1
    assert spans[0].kind == trace.SpanKind.SERVER
    assert spans[0].context.trace_id == root.get_span_context().trace_id
    assert spans[0].parent.span_id == root.get_span_context().span_id
