"""Redis goes away mid-run and comes back: the stated behaviour, then full recovery.

docs/deployment.md ("When Redis is unavailable") states it: quotas fail closed (503
redis_unavailable, Retry-After) unless CONVEYOR_GATEWAY_QUOTA_FAIL_OPEN; keys this
gateway saw valid still authenticate; routing uses the registry's last listing, else
the static engines; timelines are best effort; no request waits past the Redis
timeout; /ready stays 200. When Redis is back, everything works again without a
restart. The test runs its own redis-server (with an append-only file, as production
does, so keys survive the restart) on a port of its own.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from conveyor.gateway.tenancy.api_keys import ApiKeyStore
from conveyor.gateway.tenancy.tiers import build_tiers
from devkit.ports import free_port

pytestmark = pytest.mark.slow

TIERS = {"e2e-outage": {"priority": 10, "requests_per_minute": None,
                        "tokens_per_minute": None, "max_concurrent_requests": 4}}
BODY = {"model": "smollm2-135m-instruct", "max_tokens": 2, "temperature": 0,
        "messages": [{"role": "user", "content": "Say hi."}]}
REDIS_TIMEOUT_S = 1.0


class RedisServer:
    """A redis-server process of this test's own, restartable on the same port."""

    def __init__(self, directory: Path):
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._dir = directory
        self._process: subprocess.Popen | None = None

    def start(self) -> None:
        self._process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes", "--dir", str(self._dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()  # a clean shutdown writes the append-only file
            self._process.wait(timeout=10)
            self._process = None


@pytest.fixture
def own_redis(tmp_path):
    if subprocess.run(["which", "redis-server"], capture_output=True).returncode:
        pytest.skip("redis-server is not installed")
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


async def _create_key(url: str, prefix: str) -> str:
    redis = Redis.from_url(url, decode_responses=True)
    try:
        store = ApiKeyStore(redis, build_tiers(TIERS), prefix=prefix)
        return (await store.create(f"t-{uuid.uuid4().hex[:8]}", "e2e-outage")).key
    finally:
        await redis.aclose()


async def _post(base_url: str, key: str) -> tuple[httpx.Response, float]:
    async with httpx.AsyncClient(base_url=base_url, timeout=60,
                                 headers={"Authorization": f"Bearer {key}"}) as client:
        started = time.monotonic()
        response = await client.post("/v1/chat/completions", json=BODY)
        return response, time.monotonic() - started


async def _until_ok(base_url: str, key: str, timeout_s: float) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    while True:
        response, _ = await _post(base_url, key)
        if response.status_code == 200 or time.monotonic() > deadline:
            return response
        await asyncio.sleep(0.2)


async def test_redis_outage_has_the_stated_behaviour_and_recovers(stack, launch, own_redis):
    env = {"CONVEYOR_GATEWAY_REDIS_URL": own_redis.url,
           "CONVEYOR_GATEWAY_AUTH_ENABLED": "true",
           "CONVEYOR_GATEWAY_TIERS": json.dumps(TIERS),
           "CONVEYOR_GATEWAY_REDIS_TIMEOUT_S": str(REDIS_TIMEOUT_S)}
    closed = launch.gateway("gateway-redis-closed", **env)
    opened = launch.gateway("gateway-redis-open", CONVEYOR_GATEWAY_QUOTA_FAIL_OPEN="true", **env)
    closed_url, open_url = (f"http://127.0.0.1:{g.port}" for g in (closed, opened))
    key = await _create_key(own_redis.url, stack.redis_prefix)
    never_seen_key = await _create_key(own_redis.url, stack.redis_prefix)
    for url in (closed_url, open_url):  # both gateways see the key valid once
        response, _ = await _post(url, key)
        assert response.status_code == 200, response.text

    own_redis.stop()
    refused, seconds = await _post(closed_url, key)
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "redis_unavailable"
    assert refused.headers["retry-after"]
    assert seconds < 10 * REDIS_TIMEOUT_S
    unknown, _ = await _post(closed_url, never_seen_key)
    assert unknown.status_code == 503  # cannot be checked: refused, never let through
    served, seconds = await _post(open_url, key)
    assert served.status_code == 200, served.text  # fail open: unmetered, known key
    assert seconds < 30
    async with httpx.AsyncClient(timeout=10) as client:
        assert (await client.get(f"{closed_url}/ready")).status_code == 200
        assert (await client.get(f"{closed_url}/health")).status_code == 503

    own_redis.start()  # the same port, its append-only file reloaded
    for url in (closed_url, open_url):
        response = await _until_ok(url, key, timeout_s=15)
        assert response.status_code == 200, response.text
        request_id = response.headers["x-request-id"]
        async with httpx.AsyncClient(base_url=url, timeout=10,
                                     headers={"Authorization": f"Bearer {key}"}) as client:
            timeline = (await client.get(f"/v1/requests/{request_id}")).json()
        assert timeline["finish_reason"] == "length" and timeline["finished"] is not None
