"""A real engine process in the real Redis registry: it registers once bound, with its
address and load; SIGTERM removes it at once (before the drain, while a stream still runs);
after SIGKILL it drops out when its TTL runs out."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from conveyor.common.engine_registry import EngineRegistry
from conveyor.common.grpc_client import open_channel
from conveyor.v1 import engine_pb2, engine_pb2_grpc
from devkit.service_process import ServiceProcess

pytestmark = pytest.mark.slow

TTL_S = 2.0


def _engine(prefix: str, engine_id: str, **settings: str) -> ServiceProcess:
    return ServiceProcess("conveyor.engine", {
        "HF_HUB_OFFLINE": "1",
        "CONVEYOR_ENGINE_PORT": "0",
        "CONVEYOR_ENGINE_MAX_MODEL_LEN": "512",
        "CONVEYOR_ENGINE_KV_CACHE_GIB": "0.05",
        "CONVEYOR_ENGINE_TORCH_THREADS": "1",
        "CONVEYOR_ENGINE_ENGINE_ID": engine_id,
        "CONVEYOR_ENGINE_REDIS_URL": "redis://127.0.0.1:6379/0",
        "CONVEYOR_ENGINE_REDIS_PREFIX": prefix,
        "CONVEYOR_ENGINE_HEARTBEAT_INTERVAL_S": "0.5",
        "CONVEYOR_ENGINE_REGISTRY_TTL_S": str(TTL_S),
        "CONVEYOR_ENGINE_DRAIN_TIMEOUT_S": "30",
        **{f"CONVEYOR_ENGINE_{name}": value for name, value in settings.items()},
    }, name=engine_id)


async def _wait_until_gone(registry: EngineRegistry, timeout_s: float) -> float:
    """Seconds until the registry lists no engine (fails after timeout_s)."""
    start = time.monotonic()
    while await registry.list_live():
        assert time.monotonic() - start < timeout_s, "engine still registered"
        await asyncio.sleep(0.05)
    return time.monotonic() - start


async def _running_load(registry: EngineRegistry, timeout_s: float = 3.0) -> int:
    """The one engine's num_running once a heartbeat reports it busy (or at timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        [entry] = await registry.list_live()
        if entry.load.num_running or time.monotonic() > deadline:
            return entry.load.num_running
        await asyncio.sleep(0.1)


async def test_registers_with_load_and_drops_out_after_sigkill(redis, prefix):
    """The entry carries the engine's own block size and max_model_len, which gateways
    hash prefix hints and check prompts by."""
    process = _engine(prefix, "reg-killed", BLOCK_SIZE="32").start(timeout_s=300)
    try:
        registry = EngineRegistry(redis, prefix=prefix, ttl_s=TTL_S)
        [entry] = await registry.list_live("smollm2-135m-instruct")
        assert (entry.engine_id, entry.address) == ("reg-killed", process.address)
        assert (entry.block_size, entry.max_model_len) == (32, 512)
        assert entry.load.num_requests == 0 and entry.load.kv_usage == 0.0
        assert (entry.load.max_num_waiting_seqs, entry.load.max_num_waiting_tokens) == (256, 16384)
        assert entry.load.num_free_blocks == entry.load.num_blocks > 0
        process.kill()
        assert await _wait_until_gone(registry, timeout_s=TTL_S + 2) <= TTL_S + 1
    finally:
        process.kill()


async def test_sigterm_deregisters_before_draining_a_running_stream(redis, prefix):
    process = _engine(prefix, "reg-drained").start(timeout_s=300)
    channel = open_channel(process.address)
    try:
        registry = EngineRegistry(redis, prefix=prefix, ttl_s=TTL_S)
        stream = engine_pb2_grpc.EngineStub(channel).Generate(engine_pb2.GenerateRequest(
            request_id="long", prompt_token_ids=[1, 2, 3], sampling=engine_pb2.SamplingParams(
                temperature=0.0, max_tokens=400, ignore_eos=True)))
        first = await stream.read()
        assert first.token_ids
        assert await _running_load(registry) == 1  # a heartbeat carries the loop's load
        process._proc.send_signal(signal.SIGTERM)
        assert await _wait_until_gone(registry, timeout_s=1.0) < 1.0
        assert process.is_alive()  # still draining the stream
        stream.cancel()
        assert await asyncio.to_thread(process.stop) == 0, process.output()
    finally:
        await channel.close()
        process.kill()
