"""Tenancy end to end: real gateway processes with API keys on, the real Redis, the
real model. Keys are made with the same store the CLI uses (one test runs the CLI).

- 5 requests per minute: the 6th is 429 with Retry-After and an OpenAI body;
  two gateway processes share one budget.
- 401 for a missing or wrong key, same body shape.
- 20 concurrent requests against a token budget: exactly those that fit are admitted.
- A premium request overtakes batch requests queued before it on a saturated engine.
- GET /v1/requests/{id}: the request's stages for its tenant, 404 for another tenant.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid

import httpx
import pytest
from redis.asyncio import Redis

from conveyor.gateway.tenancy.api_keys import ApiKeyStore
from conveyor.gateway.tenancy.tiers import build_tiers

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"

TIERS = {
    "e2e-5rpm": {"priority": 10, "requests_per_minute": 5, "tokens_per_minute": None,
                 "max_concurrent_requests": None},
    "e2e-tokens": {"priority": 10, "requests_per_minute": None, "tokens_per_minute": 1000,
                   "max_concurrent_requests": None},
}
"""Test tiers next to the defaults; e2e-tokens' budget is set per test (TOKEN_BUDGET env)."""


def _prompt(text: str, max_tokens: int = 1, **extra) -> dict:
    return {"model": MODEL, "prompt": text, "max_tokens": max_tokens, "temperature": 0,
            **extra}


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.fixture
def create_key(stack):
    """`await create_key(tier)`: a new key of a fresh tenant (fresh quotas) in `tier`,
    made by the store the CLI uses, in the stack's Redis namespace."""
    async def create(tier: str) -> str:
        redis = Redis.from_url(stack.redis_url, decode_responses=True)
        try:
            store = ApiKeyStore(redis, build_tiers(TIERS), prefix=stack.redis_prefix)
            return (await store.create(f"t-{uuid.uuid4().hex[:10]}", tier)).key
        finally:
            await redis.aclose()

    return create


@pytest.fixture(scope="module")
def auth_gateways(module_launch):
    """Two gateway processes with API keys on, sharing the stack's Redis namespace."""
    env = {"CONVEYOR_GATEWAY_AUTH_ENABLED": "true", "CONVEYOR_GATEWAY_TIERS": json.dumps(TIERS)}
    gateways = [module_launch.gateway(name, **env) for name in ("gateway-auth-a", "gateway-auth-b")]
    return [f"http://127.0.0.1:{g.port}" for g in gateways]


def test_sixth_request_in_a_minute_is_429_with_retry_after(auth_gateways, create_key):
    key = asyncio.run(create_key("e2e-5rpm"))
    with httpx.Client(base_url=auth_gateways[0], headers=_auth(key), timeout=60) as client:
        allowed = [client.post("/v1/completions", json=_prompt("Hi")) for _ in range(5)]
        refused = client.post("/v1/completions", json=_prompt("Hi"))
    assert [r.status_code for r in allowed] == [200] * 5
    assert [r.headers["x-ratelimit-remaining-requests"] for r in allowed] == \
        ["4", "3", "2", "1", "0"]
    assert allowed[0].headers["x-ratelimit-limit-requests"] == "5"
    error = _error_of(refused, 429)
    assert error["type"] == "rate_limit_exceeded" and error["code"] == "rate_limit_exceeded"
    assert "requests per minute" in error["message"]
    assert 1 <= int(refused.headers["retry-after"]) <= 13  # one request per 12 s


def test_two_gateway_processes_share_one_budget(auth_gateways, create_key):
    key = asyncio.run(create_key("e2e-5rpm"))
    clients = [httpx.Client(base_url=url, headers=_auth(key), timeout=60)
               for url in auth_gateways]
    try:
        statuses = [clients[i % 2].post("/v1/completions", json=_prompt("Hi")).status_code
                    for i in range(5)]
        refused = [client.post("/v1/completions", json=_prompt("Hi")) for client in clients]
    finally:
        for client in clients:
            client.close()
    assert statuses == [200] * 5
    for response in refused:
        assert _error_of(response, 429)["type"] == "rate_limit_exceeded"
        assert "retry-after" in response.headers


def test_missing_or_wrong_key_is_401_with_an_openai_body(auth_gateways):
    with httpx.Client(base_url=auth_gateways[0], timeout=30) as client:
        missing = client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
        wrong = client.post("/v1/completions", json=_prompt("Hi"),
                            headers=_auth("cvy-not-a-real-key-0000000000000000"))
        timeline = client.get("/v1/requests/cmpl-anything")
    for response in (missing, wrong, timeline):
        error = _error_of(response, 401)
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
        assert response.headers["www-authenticate"] == "Bearer"
    assert "cvy-" in _error_of(wrong, 401)["message"]  # redacted, recognisable
    assert "0000000000000000" not in _error_of(wrong, 401)["message"]


async def test_20_concurrent_requests_admit_exactly_what_fits_the_token_budget(
        stack, launch, create_key):
    max_tokens, fits = 4, 7
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as plain:
        counted = await plain.post("/tokenize", json={"model": MODEL, "prompt": "Count: 1 2 3"})
    cost = counted.json()["count"] + max_tokens
    # Budget for `fits` requests and one token; refilling one more request takes ~8 s.
    tiers = {**TIERS, "e2e-tokens": {**TIERS["e2e-tokens"],
                                     "tokens_per_minute": fits * cost + 1}}
    gateway = launch.gateway("gateway-tokens", CONVEYOR_GATEWAY_AUTH_ENABLED="true",
                             CONVEYOR_GATEWAY_TIERS=json.dumps(tiers))
    key = await create_key("e2e-tokens")
    body = _prompt("Count: 1 2 3", max_tokens, ignore_eos=True)  # spends all of max_tokens
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway.port}",
                                 headers=_auth(key), timeout=120) as client:
        responses = await asyncio.gather(
            *(client.post("/v1/completions", json=body) for _ in range(20)))
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200] * fits + [429] * (20 - fits)
    for refused in (r for r in responses if r.status_code == 429):
        error = _error_of(refused, 429)
        assert error["type"] == "rate_limit_exceeded" and "tokens per minute" in error["message"]
    for served in (r for r in responses if r.status_code == 200):
        usage = served.json()["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (cost - max_tokens,
                                                                          max_tokens)


def test_timeline_is_readable_by_its_tenant_only(auth_gateways, create_key):
    key, other_key = (asyncio.run(create_key("standard")) for _ in range(2))
    with httpx.Client(base_url=auth_gateways[0], timeout=60) as client:
        served = client.post("/v1/completions", json=_prompt("Hello", 3, ignore_eos=True),
                             headers=_auth(key))
        assert served.status_code == 200, served.text
        request_id = served.headers["x-request-id"]
        assert served.json()["id"] == request_id
        # The timeline's last write (finished) may land just after the response.
        timeline = _wait_for_finished(client, request_id, key)
        foreign = client.get(f"/v1/requests/{request_id}", headers=_auth(other_key))
        unknown = client.get("/v1/requests/cmpl-unknown", headers=_auth(key))
    stages = [timeline[s] for s in ("arrival", "admitted", "queued", "first_token", "finished")]
    assert stages == sorted(stages) and None not in stages
    assert timeline["request_id"] == request_id
    assert timeline["num_prompt_tokens"] == served.json()["usage"]["prompt_tokens"]
    assert timeline["num_completion_tokens"] == 3 and timeline["finish_reason"] == "length"
    assert timeline["engine_id"] == served.headers["x-conveyor-engine"]
    assert 0 < timeline["time_to_first_token_s"] <= timeline["duration_s"]
    for response in (foreign, unknown):
        assert _error_of(response, 404)["code"] == "request_not_found"


def _wait_for_finished(client: httpx.Client, request_id: str, key: str) -> dict:
    deadline = time.monotonic() + 5
    while True:
        response = client.get(f"/v1/requests/{request_id}", headers=_auth(key))
        assert response.status_code == 200, response.text
        if response.json()["finished"] is not None or time.monotonic() > deadline:
            return response.json()
        time.sleep(0.05)


def test_cli_creates_a_key_that_works_and_revokes_it(stack, auth_gateways):
    env = {**os.environ, "CONVEYOR_GATEWAY_REDIS_URL": stack.redis_url,
           "CONVEYOR_GATEWAY_REDIS_PREFIX": stack.redis_prefix}

    def cli(*args: str) -> str:
        return subprocess.run([sys.executable, "-m", "conveyor.gateway.tenancy", *args],
                              env=env, check=True, capture_output=True, text=True).stdout

    tenant = f"cli-{uuid.uuid4().hex[:8]}"
    created = cli("create", "--tenant", tenant, "--tier", "standard")
    key = created.strip()  # the key alone on stdout (the rest goes to stderr)
    key_id = next(line.split()[0] for line in cli("list").splitlines() if tenant in line)
    with httpx.Client(base_url=auth_gateways[1], headers=_auth(key), timeout=60) as client:
        before = client.post("/v1/completions", json=_prompt("Hi"))
        cli("revoke", key_id)
        revoked_at = time.monotonic()
        # the gateway trusts a key it checked for one heartbeat (API_KEY_CACHE_TTL_S, 1 s)
        while (after := client.post("/v1/completions", json=_prompt("Hi"))).status_code == 200:
            assert time.monotonic() - revoked_at < 1.0 + 1.0, "the revoked key still works"
            time.sleep(0.05)
    assert before.status_code == 200, before.text
    assert _error_of(after, 401)["code"] == "invalid_api_key"


# --- priority -------------------------------------------------------------------------

async def test_premium_first_token_beats_batch_requests_queued_before_it(launch, create_key):
    [engine] = launch.engines("engine-2-seats", MAX_NUM_SEQS="2")  # the rest queue
    gateway = launch.gateway("gateway-priority", CONVEYOR_GATEWAY_AUTH_ENABLED="true",
                             CONVEYOR_GATEWAY_ENGINE_ADDRESSES=engine.address)
    batch_key, premium_key = await asyncio.gather(create_key("batch"), create_key("premium"))
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway.port}",
                                 timeout=300) as client:
        first_tokens = await _race_premium_against_queued_batch(
            client, engine.address, batch_key, premium_key)
    premium, queued = first_tokens["premium"], [first_tokens[f"queued-{i}"] for i in range(3)]
    assert premium < min(queued), first_tokens


async def _race_premium_against_queued_batch(client: httpx.AsyncClient, engine_address: str,
                                             batch_key: str, premium_key: str) -> dict:
    """2 long batch streams (of different lengths, so one seat frees first) fill the
    engine, 3 short batch streams queue behind them, then a premium stream arrives;
    returns each stream's first-token time."""
    first_tokens: dict[str, float] = {}

    async def stream(name: str, key: str, max_tokens: int) -> None:
        body = _prompt(f"Story {name}:", max_tokens, ignore_eos=True, stream=True)
        async with client.stream("POST", "/v1/completions", json=body,
                                 headers=_auth(key)) as response:
            assert response.status_code == 200, await response.aread()
            first_tokens[name] = time.monotonic()  # headers go out with the first output
            await response.aread()

    running = [asyncio.create_task(stream(f"running-{i}", batch_key, n))
               for i, n in enumerate((64, 160))]
    await _wait_for_engine(engine_address, num_running=2, num_waiting=0)
    queued = [asyncio.create_task(stream(f"queued-{i}", batch_key, 2)) for i in range(3)]
    await _wait_for_engine(engine_address, num_running=2, num_waiting=3)
    await asyncio.gather(stream("premium", premium_key, 2), *running, *queued)
    return first_tokens


async def _wait_for_engine(address: str, num_running: int, num_waiting: int) -> None:
    from conveyor.common.grpc_client import open_channel
    from conveyor.gateway.clients.engine import EngineClient

    channel = open_channel(address)
    try:
        engine = EngineClient(address, channel, rpc_timeout_s=5)
        deadline = asyncio.get_running_loop().time() + 60
        while True:
            stats = await engine.stats()
            if (stats.num_running, stats.num_waiting) == (num_running, num_waiting):
                return
            assert asyncio.get_running_loop().time() < deadline, stats
            await asyncio.sleep(0.02)
    finally:
        await channel.close()
