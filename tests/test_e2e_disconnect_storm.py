"""A storm of clients that hang up at random points leaves nothing behind.

200 requests (streaming, then non-streaming) of one tenant whose tier allows 40
concurrent requests, at most 40 open at once, each dropped at a seeded random point:
before the first chunk, after 1-5 chunks, or after 50-800 ms. Within 5 s of the last
hang-up the engine is idle with a whole KV pool, the tenant's 40 concurrency slots are
free again (40 concurrent requests all get 200), and every timeline has an end state.
"""

from __future__ import annotations

import asyncio
import json
import random
import uuid

import httpx
import pytest
from redis.asyncio import Redis

from conveyor.gateway.tenancy.api_keys import ApiKeyStore
from conveyor.gateway.tenancy.tiers import build_tiers

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
TIER = "e2e-storm"
TIERS = {TIER: {"priority": 10, "requests_per_minute": None, "tokens_per_minute": None,
                "max_concurrent_requests": 40}}
NUM_REQUESTS = 200
MAX_OPEN = 40
IDLE_WITHIN_S = 5.0


def _body(stream: bool, max_tokens: int = 48) -> dict:
    return {"model": MODEL, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream,
            "messages": [{"role": "user", "content": "Tell me a long story about a river."}]}


@pytest.fixture(scope="module")
def storm_gateway(module_launch):
    env = {"CONVEYOR_GATEWAY_AUTH_ENABLED": "true", "CONVEYOR_GATEWAY_TIERS": json.dumps(TIERS)}
    return f"http://127.0.0.1:{module_launch.gateway('gateway-storm', **env).port}"


@pytest.fixture
async def tenant(stack):
    """A fresh tenant of the storm tier: (tenant id, its key)."""
    redis = Redis.from_url(stack.redis_url, decode_responses=True)
    try:
        store = ApiKeyStore(redis, build_tiers(TIERS), prefix=stack.redis_prefix)
        tenant_id = f"storm-{uuid.uuid4().hex[:10]}"
        return tenant_id, (await store.create(tenant_id, TIER)).key
    finally:
        await redis.aclose()


async def _hang_up_before_first_chunk(url: str, headers: dict, body: dict,
                                      rng: random.Random) -> None:
    """Send the whole request, then close the connection within 20 ms."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    payload = json.dumps(body).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n{head}"
                 f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
                 .encode() + payload)
    await writer.drain()
    await asyncio.sleep(rng.uniform(0, 0.02))
    writer.close()


async def _hang_up_after_chunks(client: httpx.AsyncClient, body: dict, num_chunks: int) -> None:
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        seen = 0
        async for line in response.aiter_lines():
            seen += line.startswith("data: {")
            if seen >= num_chunks:
                return  # leaving the block closes the unfinished response's connection


async def _hang_up_after(client: httpx.AsyncClient, body: dict, seconds: float) -> None:
    async def whole_response():
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            async for _ in response.aiter_bytes():
                pass

    try:
        await asyncio.wait_for(whole_response(), seconds)
    except TimeoutError:
        pass


async def _storm(url: str, key: str, stream: bool, seed: int) -> None:
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {key}"}
    gate = asyncio.Semaphore(MAX_OPEN)
    limits = httpx.Limits(max_connections=MAX_OPEN, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60,
                                 limits=limits) as client:
        async def one(i: int) -> None:
            kind = rng.choice(["before", "chunks", "ms"] if stream else ["before", "ms"])
            chunks, delay = rng.randint(1, 5), rng.uniform(0.05, 0.8)
            async with gate:
                if kind == "before":
                    await _hang_up_before_first_chunk(url, headers, _body(stream), rng)
                elif kind == "chunks":
                    await _hang_up_after_chunks(client, _body(stream), chunks)
                else:
                    await _hang_up_after(client, _body(stream), delay)

        await asyncio.gather(*(one(i) for i in range(NUM_REQUESTS)))


async def _free_slots_and_timelines(stack, tenant_id: str) -> tuple[int, list[dict]]:
    redis = Redis.from_url(stack.redis_url, decode_responses=True)
    try:
        slots = await redis.zcard(f"{stack.redis_prefix}:quota:{{{tenant_id}}}:concurrency")
        timelines = []
        async for name in redis.scan_iter(match=f"{stack.redis_prefix}:timeline:*", count=1000):
            row = await redis.hgetall(name)
            if row.get("tenant_id") == tenant_id:
                timelines.append(row)
        return slots, timelines
    finally:
        await redis.aclose()


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "non-streaming"])
async def test_clients_hanging_up_at_random_points_leave_nothing_behind(
        stack, storm_gateway, tenant, idle_engine, stream):
    tenant_id, key = tenant
    await _storm(storm_gateway, key, stream, seed=1234 + stream)

    stats = await idle_engine(IDLE_WITHIN_S)
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert stats.num_free_blocks == stats.num_blocks

    loop = asyncio.get_running_loop()
    deadline = loop.time() + IDLE_WITHIN_S
    while (slots := (await _free_slots_and_timelines(stack, tenant_id))[0]) and \
            loop.time() < deadline:
        await asyncio.sleep(0.05)
    assert slots == 0, f"{slots} concurrency slots still taken"

    async with httpx.AsyncClient(base_url=storm_gateway, timeout=120,
                                 headers={"Authorization": f"Bearer {key}"}) as client:
        replies = await asyncio.gather(*(client.post("/v1/chat/completions",
                                                     json=_body(False, max_tokens=2))
                                         for _ in range(MAX_OPEN)))
    assert [r.status_code for r in replies] == [200] * MAX_OPEN, \
        [r.text for r in replies if r.status_code != 200][:3]

    _, timelines = await _free_slots_and_timelines(stack, tenant_id)
    ended = [t for t in timelines if "finished" in t]
    print(f"{len(timelines)} timelines, {len(ended)} with an end state; end states: "
          f"{sorted({t.get('finish_reason') for t in ended})}")
    assert len(timelines) >= MAX_OPEN
    assert len(ended) == len(timelines)
    # rejected: a 429 while the gateway had not yet seen an earlier client go
    assert {t["finish_reason"] for t in ended} <= {"cancelled", "length", "rejected"}
