"""The generation endpoint over tenancy: keys, quotas settled on every exit, the
tier's priority and the tenant's cache salt reaching the engine, timelines, and
Redis trouble as a 503 (fake gRPC services, real Redis)."""

from __future__ import annotations

import asyncio
import json

import pytest

from conveyor.gateway.tenancy.api_keys import ApiKeyStore
from conveyor.gateway.tenancy.tiers import build_tiers

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5}
ONE_AT_A_TIME = {"solo": {"priority": 5, "requests_per_minute": None,
                          "tokens_per_minute": None, "max_concurrent_requests": 1}}


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.fixture
def create_key(redis, prefix):
    """`await create_key(tenant, tier)`: auth headers of a new key in the gateways'
    Redis namespace."""
    store = ApiKeyStore(redis, build_tiers(ONE_AT_A_TIME), prefix=prefix)

    async def create(tenant: str, tier: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {(await store.create(tenant, tier)).key}"}

    return create


@pytest.fixture
async def keyed_gateway(gateway_factory):
    return await gateway_factory(auth_enabled=True, tiers=ONE_AT_A_TIME)


async def test_auth_on_refuses_without_a_key_and_serves_with_one(keyed_gateway, create_key):
    headers = await create_key("acme", "standard")
    async with keyed_gateway.client() as client:
        missing = await client.post("/v1/chat/completions", json=CHAT)
        served = await client.post("/v1/chat/completions", json=CHAT, headers=headers)
    assert error_of(missing, 401)["code"] == "invalid_api_key"
    assert served.status_code == 200
    assert served.headers["x-ratelimit-limit-requests"] == "120"
    assert served.headers["x-ratelimit-remaining-requests"] == "119"


async def test_rate_limit_headers_go_out_before_the_stream(keyed_gateway, create_key):
    headers = await create_key("acme", "standard")
    async with keyed_gateway.client() as client, client.stream(
            "POST", "/v1/chat/completions", json={**CHAT, "stream": True},
            headers=headers) as response:
        assert response.headers["x-ratelimit-limit-tokens"] == "200000"
        assert "x-conveyor-engine" in response.headers
        await response.aread()


async def test_priority_is_the_tiers_plus_the_requests_offset_and_salt_is_the_tenants(
        keyed_gateway, create_key):
    headers = await create_key("acme", "premium")
    async with keyed_gateway.client() as client:
        served = await client.post("/v1/chat/completions", json={**CHAT, "priority": 3},
                                   headers=headers)
        refused = await client.post("/v1/chat/completions", json={**CHAT, "priority": -1},
                                    headers=headers)
    assert served.status_code == 200
    [request] = keyed_gateway.fakes.engine.requests
    assert (request.priority, request.cache_salt) == (3, "tenant:acme")
    assert error_of(refused, 400)["code"] == "invalid_priority"


async def test_a_requests_cache_salt_joins_the_tenants(keyed_gateway, create_key,
                                                       monkeypatch):
    """vLLM's cache_salt narrows the tenant's sharing; it never widens it: no request salt
    makes another tenant's salt. The router's prefix affinity hashes the same salt the
    engine's prefix cache keys use."""
    headers = await create_key("acme", "standard")
    router, routed_salts = keyed_gateway.pipeline.router, []
    pick = router.pick

    async def recorded_pick(*args, **kwargs):
        routed_salts.append(kwargs["cache_salt"])
        return await pick(*args, **kwargs)

    monkeypatch.setattr(router, "pick", recorded_pick)
    async with keyed_gateway.client() as client:
        for salt in ("s1", "tenant:other"):
            served = await client.post("/v1/chat/completions",
                                       json={**CHAT, "cache_salt": salt}, headers=headers)
            assert served.status_code == 200
        empty = await client.post("/v1/chat/completions", json={**CHAT, "cache_salt": ""},
                                  headers=headers)
    assert [r.cache_salt for r in keyed_gateway.fakes.engine.requests] == [
        '["tenant:acme", "s1"]', '["tenant:acme", "tenant:other"]'] == routed_salts
    assert error_of(empty, 400)["param"] == "cache_salt"


async def test_the_slot_comes_back_after_a_client_goes_away_mid_stream(
        keyed_gateway, create_key, wait_until):
    headers = await create_key("solo-tenant", "solo")
    engine = keyed_gateway.fakes.engine
    engine.delay_s = 0.05
    async with keyed_gateway.client() as client:
        async with client.stream("POST", "/v1/chat/completions", headers=headers,
                                 json={**CHAT, "max_tokens": 50, "stream": True}) as response:
            busy = await client.post("/v1/chat/completions", json=CHAT, headers=headers)
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    break
        await wait_until(lambda: not engine.running)
        engine.delay_s = 0
        after = await _retry_while_429(client, headers)
    assert error_of(busy, 429)["message"].startswith("Rate limit reached on concurrent")
    assert after.status_code == 200


async def test_the_slot_comes_back_after_an_engine_failure(keyed_gateway, create_key):
    headers = await create_key("solo-tenant", "solo")
    keyed_gateway.fakes.engine.fail_after = 0
    async with keyed_gateway.client() as client:
        failed = await client.post("/v1/chat/completions", json=CHAT, headers=headers)
        keyed_gateway.fakes.engine.fail_after = None
        after = await client.post("/v1/chat/completions", json=CHAT, headers=headers)
    assert failed.status_code == 500 and after.status_code == 200


async def _retry_while_429(client, headers, timeout_s: float = 2.0):
    """The settle after a disconnect runs as the stream closes: give it a moment."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        response = await client.post("/v1/chat/completions", json=CHAT, headers=headers)
        if response.status_code != 429 or asyncio.get_running_loop().time() > deadline:
            return response
        await asyncio.sleep(0.05)


async def test_the_timeline_of_a_request(gateway):
    async with gateway.client() as client:
        served = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        request_id = served.headers["x-request-id"]
        timeline = await _finished_timeline(client, request_id)
    assert timeline["tenant_id"] == "anonymous" and timeline["finish_reason"] == "length"
    assert timeline["arrival"] <= timeline["admitted"] <= timeline["queued"] \
        <= timeline["first_token"] <= timeline["finished"]
    assert (timeline["num_completion_tokens"], timeline["num_cached_tokens"]) == (5, 3)
    # the fake engine's usage: 2 drafts verified per token, 1 accepted
    assert (timeline["num_draft_tokens"], timeline["num_accepted_draft_tokens"]) == (10, 5)
    assert timeline["engine_id"] == served.headers["x-conveyor-engine"]


async def test_the_draft_counts_of_n_samples_add_up_on_the_timeline_only(gateway):
    async with gateway.client() as client:
        served = await client.post("/v1/chat/completions", json={**CHAT, "n": 3})
        timeline = await _finished_timeline(client, served.headers["x-request-id"])
    assert (timeline["num_draft_tokens"], timeline["num_accepted_draft_tokens"]) == (30, 15)
    assert set(served.json()["usage"]) == {  # OpenAI's usage has no draft counts (vLLM's neither)
        "prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"}


async def test_a_rejected_request_has_a_finished_timeline(gateway):
    async with gateway.client() as client:
        refused = await client.post("/v1/chat/completions", json={**CHAT, "model": "other"})
        timeline = await _finished_timeline(client, refused.headers["x-request-id"])
    assert refused.status_code == 404
    assert timeline["finish_reason"] == "rejected" and timeline["admitted"] is None
    assert timeline["num_draft_tokens"] is None


async def _finished_timeline(client, request_id: str, timeout_s: float = 2.0) -> dict:
    """The finish is written as the stream closes, just after the last byte went out."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        timeline = (await client.get(f"/v1/requests/{request_id}")).json()
        if timeline["finished"] is not None or asyncio.get_running_loop().time() > deadline:
            return timeline
        await asyncio.sleep(0.02)


async def test_redis_down_is_503_and_unhealthy(gateway_factory):
    gateway = await gateway_factory(redis_url="redis://127.0.0.1:1/0")
    async with gateway.client() as client:
        response = await client.post("/v1/chat/completions", json=CHAT)
        health = await client.get("/health")
    assert error_of(response, 503)["code"] == "redis_unavailable"
    assert health.status_code == 503 and "redis" in health.json()["down"]
    assert json.loads(health.text)["down"][0] == "redis"
