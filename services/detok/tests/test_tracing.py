"""A Generate call that carries a traceparent gets a server span under it, and the engine
call it makes is a child of that span."""

from __future__ import annotations

from detok_scripted_engine import Sample, ScriptedEngine
from opentelemetry import trace

from conveyor.common.grpc_client import Channels, open_channel
from conveyor.common.grpc_server import start_grpc_server
from conveyor.detok.server import registration
from conveyor.detok.settings import DetokSettings
from conveyor.v1 import detok_pb2, detok_pb2_grpc, engine_pb2


async def test_server_span_is_child_of_the_callers_context_and_parent_of_the_engines(
        tokenizer, span_exporter, serve_engine):
    engine = ScriptedEngine(Sample([19556]))  # "Hello"
    engine_address = await serve_engine(engine)
    engines = Channels()
    service = await start_grpc_server(DetokSettings(port=0), [registration(tokenizer, engines)])
    channel = open_channel(f"127.0.0.1:{service.port}")
    try:
        stub = detok_pb2_grpc.DetokenizerStub(channel)
        request = detok_pb2.TextGenerateRequest(
            engine_address=engine_address,
            generate=engine_pb2.GenerateRequest(prompt_token_ids=[1]))
        with trace.get_tracer("test").start_as_current_span("gateway-request") as root:
            replies = [r async for r in stub.Generate(request)]
        assert replies[0].text_delta == "Hello"
        await engine.ended()  # its span ends as its handler does
    finally:
        await channel.close()
        await service.server.stop(grace=None)
        await engines.close()
    trace_id = root.get_span_context().trace_id
    spans = [s for s in span_exporter.get_finished_spans()  # this trace's: the exporter
             if s.context.trace_id == trace_id]  # holds the whole session's spans
    [detok] = [s for s in spans if s.name == "conveyor.v1.Detokenizer/Generate"]
    [engine_span] = [s for s in spans if s.name == "conveyor.v1.Engine/Generate"]
    assert detok.kind == engine_span.kind == trace.SpanKind.SERVER
    assert detok.parent.span_id == root.get_span_context().span_id
    assert engine_span.parent.span_id == detok.context.span_id
