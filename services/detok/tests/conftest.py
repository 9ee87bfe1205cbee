"""Fixtures of the detokenizer tests: the real SmolLM2 tokenizer and an in-memory span exporter."""

from __future__ import annotations

import os

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from conveyor.common.models import load_tokenizer, resolve_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer(resolve_model("smollm2-135m-instruct"))


@pytest.fixture(scope="session")
def span_exporter() -> InMemorySpanExporter:
    """Spans finished in this process (joins a provider another test already installed)."""
    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter
