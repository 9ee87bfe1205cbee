"""SIGTERM drains every service, readiness first, over real processes.

- gateway: `/ready` answers 503 at once while `/live` stays 200 and new requests get
  503; the stream in flight still finishes; the process exits within its drain timeout.
- engine: health turns NOT_SERVING and the engine leaves the Redis registry, so new
  requests go to the other engine; its stream in flight still finishes; it exits
  within its drain timeout.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest
from redis.asyncio import Redis

from conveyor.common.engine_registry import EngineRegistry
from conveyor.common.grpc_client import is_serving, open_channel

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
STREAM = {"model": MODEL, "max_tokens": 96, "ignore_eos": True, "stream": True,
          "messages": [{"role": "user", "content": "Count to a hundred."}]}
"""Long enough (ignore_eos) that the checks made after its second chunk find it running."""
SHORT = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
DRAIN_TIMEOUT_S = 30.0
LATER_CHUNKS = 24
"""The second look at the draining gateway comes this many stream chunks after SIGTERM."""


async def test_gateway_sigterm_is_not_ready_first_and_lets_a_stream_finish(extra_gateway,
                                                                          idle_engine):
    gateway = extra_gateway(CONVEYOR_GATEWAY_DRAIN_TIMEOUT_S=str(DRAIN_TIMEOUT_S))
    lines, probes = [], {}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway.port}",
                                 timeout=60) as client:
        assert (await client.get("/ready")).status_code == 200
        async with client.stream("POST", "/v1/chat/completions", json=STREAM) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                if len(lines) == 2 and not probes:
                    signalled_at = time.monotonic()
                    os.kill(gateway.pid, signal.SIGTERM)
                    probes[len(lines)] = await _probe_gateway(client)
                if len(lines) == 2 + LATER_CHUNKS and len(probes) == 1:
                    # uvicorn alone would have stopped listening by now (it checks every 0.1 s)
                    probes[len(lines)] = await _probe_gateway(client)
    not_ready = {"ready": 503, "live": 200, "new_request": 503}
    assert probes == {2: not_ready, 2 + LATER_CHUNKS: not_ready}
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
    await _wait_until(lambda: not gateway.is_alive(), signalled_at + DRAIN_TIMEOUT_S)
    stats = await idle_engine(1.0)
    assert stats.num_free_blocks == stats.num_blocks


async def _probe_gateway(client: httpx.AsyncClient) -> dict[str, int]:
    ready, live = await client.get("/ready"), await client.get("/live")
    refused = await client.post("/v1/completions", json=SHORT)
    return {"ready": ready.status_code, "live": live.status_code,
            "new_request": refused.status_code}


async def test_engine_sigterm_leaves_routing_first_and_finishes_its_stream(stack, launch):
    prefix = f"{stack.redis_prefix}:drain"
    engines = launch.engines("e2e-drain-a", "e2e-drain-b", REDIS_PREFIX=prefix,
                             DRAIN_TIMEOUT_S=str(DRAIN_TIMEOUT_S))
    by_id = {e.name: e for e in engines}
    gateway = launch.gateway("gateway-drain", CONVEYOR_GATEWAY_ENGINE_ADDRESSES="",
                             CONVEYOR_GATEWAY_REDIS_PREFIX=prefix)
    redis = Redis.from_url(stack.redis_url, decode_responses=True)
    registry = EngineRegistry(redis, prefix=prefix)
    await _wait_until_registered(registry, set(by_id))
    lines, routed = [], None
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway.port}",
                                 timeout=60) as client:
        async with client.stream("POST", "/v1/chat/completions", json=STREAM) as response:
            draining = by_id[response.headers["x-conveyor-engine"]]
            [other] = set(by_id) - {draining.name}
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                if len(lines) == 2 and routed is None:
                    signalled_at = time.monotonic()
                    os.kill(draining.pid, signal.SIGTERM)
                    routed = await _after_engine_signal(client, registry, draining, other)
    await redis.aclose()
    assert routed == {"serving": False, "engines": [other, other, other]}
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
    await _wait_until(lambda: not draining.is_alive(), signalled_at + DRAIN_TIMEOUT_S)


async def _after_engine_signal(client: httpx.AsyncClient, registry: EngineRegistry,
                               draining, other: str) -> dict:
    """Once the signalled engine has left the registry: its health, and which engine
    each of three new requests went to."""
    channel = open_channel(draining.address)
    await _wait_until_registered(registry, {other})
    serving = await is_serving(channel)
    await channel.close()
    served = [await client.post("/v1/completions", json=SHORT) for _ in range(3)]
    assert all(r.status_code == 200 for r in served), [r.text for r in served]
    return {"serving": serving, "engines": [r.headers["x-conveyor-engine"] for r in served]}


async def _wait_until_registered(registry: EngineRegistry, engine_ids: set[str]) -> None:
    deadline = time.monotonic() + 20
    while {e.engine_id for e in await registry.list_live()} != engine_ids:
        assert time.monotonic() < deadline, f"registry never became {sorted(engine_ids)}"
        await asyncio.sleep(0.05)


async def _wait_until(condition, deadline: float) -> None:
    """Wait (without blocking the loop) until condition() holds; fail past deadline."""
    while not condition():
        assert time.monotonic() < deadline, "condition not met before the deadline"
        await asyncio.sleep(0.05)
