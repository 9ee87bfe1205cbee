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
    the bundled model (adapter_config.json + adapter_model.safetensors) with seeded random,
    non-zero A and B (PEFT's init_lora_weights=False: the adapted model writes other text),
    made with peft itself; and `reference(folder)`, transformers' fp32 model with it merged."""
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import LlamaForCausalLM

    from conveyor.engine.model.loader import resolve_checkpoint

    base_folder = resolve_checkpoint("smollm2-135m-instruct")
    every = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

    def make(rank: int, seed: int, targets: tuple[str, ...] = every) -> str:
        folder = tmp_path_factory.mktemp(f"lora-r{rank}-s{seed}")
        base = LlamaForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
        torch.manual_seed(seed)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets),
                            init_lora_weights=False)
        get_peft_model(base, config).save_pretrained(folder)
        return str(folder)

    def reference(folder: str):
        base = LlamaForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
        return PeftModel.from_pretrained(base, folder).merge_and_unload().eval()

    return SimpleNamespace(make=make, reference=reference)
