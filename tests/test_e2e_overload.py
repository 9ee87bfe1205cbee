"""Overload sheds with 503 + Retry-After, lowest tier first, and nothing else fails.

Small engines (one running request, two waiting) behind a gateway with API keys and
two tiers. The engine's bounded waiting queue refuses a lowest-priority arrival and
lets a higher-priority one push out the latest lowest-priority waiting request; the
gateway tries another engine first and answers 503 with Retry-After when none can
take it, which the official OpenAI client's own retry honours.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import grpc
import httpx
import openai
import pytest
from redis.asyncio import Redis

from conveyor.common.grpc_client import open_channel
from conveyor.gateway.clients.engine import (
    EngineClient,
    GenerateJob,
    SamplingOptions,
    generate_request,
)
from conveyor.gateway.clients.upstream import UpstreamError, translate_rpc_errors
from conveyor.gateway.tenancy.api_keys import ApiKeyStore
from conveyor.gateway.tenancy.tiers import build_tiers
from conveyor.v1 import engine_pb2, engine_pb2_grpc

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
TIERS = {"e2e-high": {"priority": 0, "requests_per_minute": None, "tokens_per_minute": None,
                      "max_concurrent_requests": None},
         "e2e-low": {"priority": 20, "requests_per_minute": None, "tokens_per_minute": None,
                     "max_concurrent_requests": None}}
LOW_PRIORITY = 20
"""The engine priority of the low tier's requests (its tier priority, no offset)."""
SMALL_ENGINE = {"MAX_NUM_SEQS": "1", "MAX_NUM_WAITING_SEQS": "2"}


def _body(max_tokens: int) -> dict:
    return {"model": MODEL, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "messages": [{"role": "user", "content": "Count slowly."}]}


@pytest.fixture(scope="module")
def overload(module_launch, stack):
    """Two small engines registered under a Redis prefix of their own, and a gateway
    with keys on that sees only them."""
    prefix = f"{stack.redis_prefix}:overload"
    engines = module_launch.engines("eng-a", "eng-b", REDIS_PREFIX=prefix, **SMALL_ENGINE)
    gateway = module_launch.gateway(
        "gateway-overload", CONVEYOR_GATEWAY_REDIS_PREFIX=prefix,
        CONVEYOR_GATEWAY_AUTH_ENABLED="true", CONVEYOR_GATEWAY_TIERS=json.dumps(TIERS),
        CONVEYOR_GATEWAY_ENGINE_ADDRESSES=",".join(e.address for e in engines))
    return f"http://127.0.0.1:{gateway.port}", prefix, engines


async def _keys(url: str, prefix: str) -> dict[str, str]:
    redis = Redis.from_url(url, decode_responses=True)
    try:
        store = ApiKeyStore(redis, build_tiers(TIERS), prefix=prefix)
        return {tier: (await store.create(f"t-{uuid.uuid4().hex[:8]}", tier)).key
                for tier in TIERS}
    finally:
        await redis.aclose()


async def _until(stats_of, condition, timeout_s: float = 60.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition(stats := await stats_of()):
        assert loop.time() < deadline, f"engine never reached the state: {stats}"
        await asyncio.sleep(0.02)
    return stats


@pytest.fixture
async def engine_clients(overload):
    _, _, engines = overload
    channels = [open_channel(e.address) for e in engines]
    yield [EngineClient(e.address, c, rpc_timeout_s=5) for e, c in zip(engines, channels,
                                                                          strict=True)]
    for channel in channels:
        await channel.close()


async def _fill(engine: EngineClient, priority: int, max_tokens: int) -> str:
    """Run one request on `engine` directly (its gRPC Generate stream, as detok opens it)
    to its end; the outcome: its finish reason, or the gRPC error's reason (queue_full)."""
    job = GenerateJob(f"fill-{uuid.uuid4().hex[:8]}", list(range(100, 120)),
                      SamplingOptions(max_tokens=max_tokens, knobs={"temperature": 0},
                                      ignore_eos=True),
                      priority=priority)
    async with grpc.aio.insecure_channel(engine.address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        try:
            with translate_rpc_errors("engine"):
                async for chunk in stub.Generate(generate_request(job)):
                    if chunk.finish_reason:
                        return engine_pb2.FinishReason.Name(chunk.finish_reason).removeprefix(
                            "FINISH_REASON_").lower()
        except UpstreamError as error:
            return error.reason or error.code
    return "none"


async def _fill_every_engine(engine_clients, max_tokens: int) -> list[asyncio.Task]:
    """One running and two waiting requests of the low tier's priority on each engine."""
    held = []
    for client in engine_clients:
        held.append(asyncio.create_task(_fill(client, LOW_PRIORITY, max_tokens)))
        await _until(client.stats, lambda s: s.num_running == 1)
        for n in (1, 2):
            held.append(asyncio.create_task(_fill(client, LOW_PRIORITY, 4)))
            await _until(client.stats, lambda s, n=n: s.num_waiting == n)
    return held


async def _num_503(url: str) -> float:
    async with httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(f"{url}/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("conveyor_gateway_requests_total{") and '"503"' in line)


async def test_a_burst_beyond_the_waiting_limit_sheds_the_lower_tier_first(
        stack, overload, engine_clients):
    url, prefix, _ = overload
    keys = await _keys(stack.redis_url, prefix)

    async def post(tier: str) -> httpx.Response:
        async with httpx.AsyncClient(base_url=url, timeout=300, headers={
                "Authorization": f"Bearer {keys[tier]}"}) as client:
            return await client.post("/v1/chat/completions", json=_body(4))

    held = await _fill_every_engine(engine_clients, max_tokens=120)
    # a low-tier arrival is refused by both engines (tried one, then the other): 503;
    # each high-tier arrival pushes out a waiting low-tier request and is served
    low = await post("e2e-low")
    highs = await asyncio.gather(post("e2e-high"), post("e2e-high"))
    assert [r.status_code for r in highs] == [200, 200], [r.text for r in highs]
    assert low.status_code == 503, low.text
    assert low.headers["retry-after"] == "1"
    assert low.json()["error"]["code"] == "engine_overloaded"
    outcomes = await asyncio.gather(*held)
    print("direct low-tier requests:", outcomes)
    assert outcomes.count("queue_full") == 2  # the two pushed out; the rest finished
    assert outcomes.count("length") == len(outcomes) - 2
    for client in engine_clients:
        stats = await _until(client.stats, lambda s: s.num_running == s.num_waiting == 0)
        assert stats.num_free_blocks == stats.num_blocks


async def test_the_openai_client_retry_honours_the_503(stack, overload, engine_clients):
    url, prefix, _ = overload
    keys = await _keys(stack.redis_url, prefix)
    held = await _fill_every_engine(engine_clients, max_tokens=40)
    num_503 = await _num_503(url)
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=keys["e2e-low"], max_retries=30,
                                timeout=300)
    body = _body(4)
    completion = await client.chat.completions.create(
        model=body["model"], messages=body["messages"], max_tokens=4, temperature=0,
        extra_body={"ignore_eos": True})
    assert completion.choices[0].finish_reason == "length"
    assert await _num_503(url) > num_503  # refused at least once, then retried and served
    await asyncio.gather(*held)
