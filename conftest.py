"""Fixtures every test folder shares (pytest loads this root conftest for all of them)."""

from __future__ import annotations

import os
import uuid
from types import SimpleNamespace

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from redis.asyncio import Redis


@pytest.fixture(scope="session")
def span_exporter() -> InMemorySpanExporter:
    """Spans finished in this test process. OpenTelemetry allows one tracer provider per
    process, so this installs it once (or joins one already installed) for every folder."""
    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


REDIS_URL = os.environ.get("CONVEYOR_REDIS_URL", "redis://127.0.0.1:6379/0")
"""The real Redis the tests use (`make test` starts one when none answers)."""


async def _connect_redis(**options) -> Redis:
    client = Redis.from_url(REDIS_URL, **options)
    try:
        await client.ping()
    except Exception as exc:  # noqa: BLE001 - any failure means no Redis to test against
        pytest.fail(f"no Redis at {REDIS_URL} ({exc}); start one with `make redis`")
    return client


@pytest.fixture(scope="session")
def redis_url() -> str:
    """REDIS_URL, for processes and settings that connect on their own."""
    return REDIS_URL


@pytest.fixture
async def redis():
    """A client of the real Redis, decoding responses to str."""
    client = await _connect_redis(decode_responses=True)
    yield client
    await client.aclose()


@pytest.fixture
async def other_redis():
    """A second, independent client: another gateway (or engine) replica."""
    client = await _connect_redis(decode_responses=True)
    yield client
    await client.aclose()


@pytest.fixture
async def prefix(redis):
    """A fresh key namespace for one test; its keys are deleted afterwards."""
    namespace = f"test:{uuid.uuid4().hex}"
    yield namespace
    keys = [key async for key in redis.scan_iter(match=f"{namespace}:*")]
    if keys:
        await redis.delete(*keys)


@pytest.fixture(scope="session")
def make_lora_adapter(tmp_path_factory):
    """`make(rank, seed, targets=all seven projections) -> folder`: a PEFT LoRA adapter of
    the bundled model with seeded random, non-zero A and B, made with peft itself
    (bench/lora.py); `reference(folder)`: transformers' fp32 model with it merged."""
    import torch
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    from bench.lora import MODEL, PROJECTIONS, make_adapter
    from conveyor.engine.model.loader import resolve_checkpoint

    def make(rank: int, seed: int, targets: tuple[str, ...] = PROJECTIONS) -> str:
        return make_adapter(str(tmp_path_factory.mktemp(f"lora-r{rank}-s{seed}")), rank, seed,
                            targets)

    def reference(folder: str):
        base = LlamaForCausalLM.from_pretrained(resolve_checkpoint(MODEL), dtype=torch.float32)
        return PeftModel.from_pretrained(base, folder).merge_and_unload().eval()

    return SimpleNamespace(make=make, reference=reference)
