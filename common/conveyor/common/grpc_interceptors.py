"""gRPC interceptors: a server span per RPC whose parent is the caller's trace
context, and the current trace context injected into every outgoing call."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from conveyor.common.log import request_id_var
from conveyor.common.tracing import extract_context, inject_metadata

REQUEST_ID_KEY = "x-request-id"


class TracingServerInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every handler in a SERVER span named after the RPC method."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        metadata = tuple(handler_call_details.invocation_metadata or ())
        return _wrap_handler(handler, method, metadata)


def _wrap_handler(handler: grpc.RpcMethodHandler, method: str, metadata) -> grpc.RpcMethodHandler:
    rpc = _ServerSpan(method.lstrip("/"), extract_context(metadata),
                      dict((k, v) for k, v in metadata if isinstance(v, str)).get(REQUEST_ID_KEY))
    if handler.unary_unary:
        return handler._replace(unary_unary=rpc.unary(handler.unary_unary))
    if handler.stream_unary:
        return handler._replace(stream_unary=rpc.unary(handler.stream_unary))
    if handler.unary_stream:
        return handler._replace(unary_stream=rpc.stream(handler.unary_stream))
    return handler._replace(stream_stream=rpc.stream(handler.stream_stream))


@dataclass(frozen=True, slots=True)
class _ServerSpan:
    """One RPC's SERVER span (child of the caller's `parent` context) around its handler,
    with the caller's request id in the log context."""

    name: str
    parent: otel_context.Context
    request_id: str | None

    def unary(self, behavior: Callable) -> Callable:
        async def wrapped(request_or_iterator, context):
            request_id_var.set(self.request_id)
            with _tracer().start_as_current_span(self.name, context=self.parent,
                                                 kind=SpanKind.SERVER) as span:
                try:
                    return await behavior(request_or_iterator, context)
                except Exception as exc:
                    _record(span, context, exc)
                    raise

        return wrapped

    def stream(self, behavior: Callable) -> Callable:
        async def wrapped(request_or_iterator, context) -> AsyncIterator:
            request_id_var.set(self.request_id)
            span = _tracer().start_span(self.name, context=self.parent, kind=SpanKind.SERVER)
            try:
                async for response in _steps_in_span(
                    behavior(request_or_iterator, context), span, self.parent
                ):
                    yield response
            except Exception as exc:
                _record(span, context, exc)
                raise
            finally:
                span.end()

        return wrapped


def _tracer() -> trace.Tracer:
    return trace.get_tracer("conveyor.grpc")


async def _steps_in_span(responses: AsyncIterator, span, parent) -> AsyncIterator:
    """Iterate a streaming handler with `span` current only while the handler runs.

    The span is attached and detached around each step, never across a `yield`:
    a stream the client cancels is closed from another context, and a context
    held across the yield could then not be detached.
    """
    span_context = trace.set_span_in_context(span, parent)
    try:
        while True:
            token = otel_context.attach(span_context)
            try:
                response = await anext(responses)
            except StopAsyncIteration:
                return
            finally:
                otel_context.detach(token)
            yield response
    finally:
        await responses.aclose()


def _record(span, context, exc: Exception) -> None:
    code = context.code() if hasattr(context, "code") else None
    span.set_attribute("rpc.grpc.status_code", int(code.value[0]) if code else 2)
    span.set_status(Status(StatusCode.ERROR, str(exc) or type(exc).__name__))


class _ClientCallDetails(grpc.aio.ClientCallDetails):
    pass


def _with_trace(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    metadata = list(details.metadata or [])
    request_id = request_id_var.get()
    if request_id and not any(key == REQUEST_ID_KEY for key, _ in metadata):
        metadata.append((REQUEST_ID_KEY, request_id))
    return _ClientCallDetails(
        details.method, details.timeout, inject_metadata(metadata),
        details.credentials, details.wait_for_ready,
    )


class _TraceUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_with_trace(client_call_details), request)


class _TraceUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_with_trace(client_call_details), request)


class _TraceStreamStream(grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(_with_trace(client_call_details), request_iterator)


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """Interceptors that carry trace context and the request id on every call."""
    return [_TraceUnaryUnary(), _TraceUnaryStream(), _TraceStreamStream()]
