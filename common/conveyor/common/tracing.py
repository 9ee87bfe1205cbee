"""OpenTelemetry setup and W3C trace context carried in gRPC metadata.

The exporter follows the standard OTEL_* variables: with
OTEL_EXPORTER_OTLP_ENDPOINT (or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) set, spans
go over OTLP/gRPC; OTEL_TRACES_EXPORTER=none (or nothing set) exports nothing.
Tests pass their own span processor (an in-memory exporter).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor


def setup_tracing(service: str, processors: Iterable[SpanProcessor] = ()) -> TracerProvider:
    """Install a tracer provider for `service` (once per process) and return it."""
    resource = Resource.create({SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME", service)})
    provider = TracerProvider(resource=resource)
    for processor in processors:
        provider.add_span_processor(processor)
    if _otlp_enabled():
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    return provider


def _otlp_enabled() -> bool:
    if os.environ.get("OTEL_TRACES_EXPORTER", "otlp").lower() == "none":
        return False
    return bool(
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def inject_metadata(metadata: list[tuple[str, str]] | None = None) -> list[tuple[str, str]]:
    """Return gRPC metadata with the current trace context (traceparent) added."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return [*(metadata or []), *carrier.items()]


def extract_context(metadata: Iterable[tuple[str, str | bytes]] | None):
    """The trace context carried by incoming gRPC metadata (empty if none)."""
    carrier: Mapping[str, str] = {
        key: value for key, value in (metadata or ()) if isinstance(value, str)
    }
    return propagate.extract(carrier)
