"""What the gateway shows of its requests: Prometheus metrics (one registry per app) and
the spans of a request (the root SERVER span of its trace and a GenAI span of its
generation under it).

The root span wraps the whole ASGI call, so it is current while the handler runs and
while a streamed body is sent: the gRPC calls the request makes (tokenizer, engine,
detok) descend from it through the client interceptors. A `traceparent` header from the
client becomes its parent. Recent FastAPI opens this span itself (its native telemetry,
with child spans for dependencies and the endpoint); RequestSpanMiddleware opens it
only when FastAPI did not.

The generation span, `chat <model>` or `text_completion <model>`, carries the
OpenTelemetry GenAI attributes. It runs from routing to the end of the response,
settlement included, which for a stream is after FastAPI's span has ended; the
middleware ends it if the request failed before it was finished.
"""

from __future__ import annotations

import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass

from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from conveyor.gateway.usage_totals import UsageTotals

# -- metrics -----------------------------------------------------------------------------

log = logging.getLogger("conveyor.gateway.requests")

DISCONNECTED_STATUS = 499
"""The status recorded (never sent) for a request whose client went away (nginx's)."""

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class GatewayMetrics:
    """Request counts and latencies, time to first token, tokens, disconnects."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("conveyor_gateway_requests", "Finished HTTP requests.",
                                ["endpoint", "status"], registry=r)
        self.request_seconds = Histogram(
            "conveyor_gateway_request_duration_seconds", "Request latency, streaming included.",
            ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.first_token_seconds = Histogram(
            "conveyor_gateway_time_to_first_token_seconds",
            "From arrival to the first generated text.", ["endpoint"],
            buckets=LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge("conveyor_gateway_requests_in_flight",
                               "Requests being served.", ["endpoint"], registry=r)
        self.client_disconnects = Counter(
            "conveyor_gateway_client_disconnects", "Requests whose client went away first.",
            ["endpoint"], registry=r)
        self.timeouts = Counter("conveyor_gateway_request_timeouts",
                                "Requests cancelled at the request timeout.", ["endpoint"],
                                registry=r)
        self.replica_calls = Counter(
            "conveyor_gateway_replica_calls", "Calls and streams sent to each tokenizer and "
            "detok replica (retries and rebuilt streams included).", ["service", "address"],
            registry=r)
        self.prompt_tokens = Counter("conveyor_gateway_prompt_tokens", "Prompt tokens served.",
                                     registry=r)
        self.cached_prompt_tokens = Counter(
            "conveyor_gateway_cached_prompt_tokens", "Prompt tokens served from prefix cache.",
            registry=r)
        self.completion_tokens = Counter("conveyor_gateway_completion_tokens",
                                         "Tokens generated.", registry=r)

    def start(self, endpoint: str) -> RequestRecord:
        return RequestRecord(self, endpoint)

    def count_replica_call(self, service: str, address: str) -> None:
        """One call or stream sent to a tokenizer or detok replica (ReplicaSet's on_pick)."""
        self.replica_calls.labels(service, address).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestRecord:
    """One request's metrics; `finish` records it once (later calls are ignored)."""

    def __init__(self, metrics: GatewayMetrics, endpoint: str):
        self._metrics = metrics
        self.endpoint = endpoint
        self._started = time.perf_counter()
        self._usage: UsageTotals | None = None
        self._first_token_seen = False
        self._finished = False
        metrics.in_flight.labels(endpoint).inc()

    def first_token(self) -> None:
        if not self._first_token_seen:
            self._first_token_seen = True
            self._metrics.first_token_seconds.labels(self.endpoint).observe(
                time.perf_counter() - self._started)

    def tokens(self, usage: UsageTotals) -> None:
        self._usage = usage
        self._metrics.prompt_tokens.inc(usage.prompt_tokens)
        self._metrics.cached_prompt_tokens.inc(usage.cached_tokens)
        self._metrics.completion_tokens.inc(usage.completion_tokens)

    def finish(self, status: int) -> None:
        if self._finished:
            return
        self._finished = True
        m = self._metrics
        seconds = time.perf_counter() - self._started
        m.in_flight.labels(self.endpoint).dec()
        m.requests.labels(self.endpoint, str(status)).inc()
        m.request_seconds.labels(self.endpoint).observe(seconds)
        tokens = (f", {self._usage.prompt_tokens} prompt + {self._usage.completion_tokens} "
                  f"completion tokens" if self._usage else "")
        log.info("%s -> %d in %.3fs%s", self.endpoint, status, seconds, tokens)
        if status == DISCONNECTED_STATUS:
            m.client_disconnects.labels(self.endpoint).inc()
        elif status == 504:
            m.timeouts.labels(self.endpoint).inc()


# -- genai span --------------------------------------------------------------------------

UNTRACED_PATHS = frozenset({"/health", "/metrics"})
"""Polled by health checks and scrapers: spans there would only be noise."""

OPERATIONS = {"chat_completions": "chat", "completions": "text_completion", "responses": "chat"}
"""gen_ai.operation.name per endpoint kind."""

_tracer = trace.get_tracer("conveyor.gateway")


@dataclass(slots=True)
class _RequestSpans:
    root: trace.Span
    generation: trace.Span | None = None


_request_spans: ContextVar[_RequestSpans | None] = ContextVar("conveyor_request_spans",
                                                              default=None)
"""The current HTTP request's spans (set by RequestSpanMiddleware)."""


class RequestSpanMiddleware:
    """Pure ASGI middleware: the request's root span (FastAPI's, else its own) and the
    lifetime of its generation span."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNTRACED_PATHS:
            await self.app(scope, receive, send)
        elif "fastapi.telemetry" in scope and trace.get_current_span().is_recording():
            await self._call_in(trace.get_current_span(), scope, receive, send)
        else:
            await self._call_in_own_span(scope, receive, send)

    async def _call_in(self, root: trace.Span, scope: Scope, receive: Receive,
                       send: Send) -> None:
        spans = _RequestSpans(root)
        token = _request_spans.set(spans)
        try:
            await self.app(scope, receive, send)
        finally:
            _request_spans.reset(token)
            if spans.generation is not None and spans.generation.is_recording():
                spans.generation.set_status(Status(StatusCode.ERROR, "not finished"))
                spans.generation.end()

    async def _call_in_own_span(self, scope: Scope, receive: Receive, send: Send) -> None:
        method = scope["method"]
        with _tracer.start_as_current_span(
                f"{method} {scope['path']}", context=_client_context(scope), kind=SpanKind.SERVER,
                attributes={"http.request.method": method, "url.path": scope["path"]}) as span:

            async def send_noting_status(message: Message) -> None:
                if message["type"] == "http.response.start":
                    _set_status(span, message["status"])
                await send(message)

            try:
                await self._call_in(span, scope, receive, send_noting_status)
            finally:
                route = scope.get("route")
                if route is not None and hasattr(route, "path"):
                    span.update_name(f"{method} {route.path}")


def describe_generation(endpoint: str, model: str, max_tokens: int | None,
                        request_id: str) -> None:
    """Open the request's generation span (once) with its GenAI request attributes."""
    spans = _request_spans.get()
    if spans is None or spans.generation is not None:
        return
    operation = OPERATIONS.get(endpoint, endpoint)
    attributes = {
        "gen_ai.operation.name": operation,
        "gen_ai.request.model": model,
        "conveyor.request.id": request_id,
    }
    if max_tokens is not None:
        attributes["gen_ai.request.max_tokens"] = max_tokens
    spans.generation = _tracer.start_span(
        f"{operation} {model}", context=trace.set_span_in_context(spans.root),
        attributes=attributes)


def record_usage(usage: UsageTotals, finish_reason: str, engine_id: str | None) -> None:
    """Set what the generation used and why it ended, and end its span."""
    spans = _request_spans.get()
    if spans is None or spans.generation is None:
        return
    attributes = {
        "gen_ai.usage.input_tokens": usage.prompt_tokens,
        "gen_ai.usage.output_tokens": usage.num_tokens_spent,
        "gen_ai.response.finish_reasons": finish_reason.split(","),
        "conveyor.usage.cached_tokens": usage.cached_tokens,
    }
    if engine_id is not None:
        attributes["conveyor.engine.id"] = engine_id
    spans.generation.set_attributes(attributes)
    spans.generation.end()


def _client_context(scope: Scope):
    headers = {key.decode("latin-1"): value.decode("latin-1")
               for key, value in scope.get("headers", ())}
    return propagate.extract(headers)


def _set_status(span: trace.Span, status: int) -> None:
    span.set_attribute("http.response.status_code", status)
    if status >= 500:
        span.set_status(Status(StatusCode.ERROR))
