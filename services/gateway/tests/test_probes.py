"""`/live` and `/ready`: readiness ignores Redis and turns 503 first on SIGTERM."""

from __future__ import annotations

import asyncio
import signal

import httpx
import uvicorn

from conveyor.gateway.app import create_app
from conveyor.gateway.server import GatewayServer
from conveyor.gateway.settings import GatewaySettings

UNREACHABLE_REDIS = "redis://127.0.0.1:1/0"
"""Nothing listens on port 1: every Redis call fails."""


async def test_ready_and_live_answer_200(gateway):
    async with gateway.client() as client:
        ready, live = await client.get("/ready"), await client.get("/live")
    assert (ready.status_code, ready.json()) == (200, {"status": "ready"})
    assert (live.status_code, live.json()) == (200, {"status": "alive"})


async def test_ready_does_not_depend_on_redis(gateway_factory):
    gateway = await gateway_factory(redis_url=UNREACHABLE_REDIS)
    async with gateway.client() as client:
        ready, health = await client.get("/ready"), await client.get("/health")
    assert ready.status_code == 200
    assert health.status_code == 503 and "redis" in health.json()["down"]


async def test_draining_is_not_ready_but_live(gateway):
    gateway.pipeline.draining = True
    async with gateway.client() as client:
        ready, live = await client.get("/ready"), await client.get("/live")
    assert (ready.status_code, ready.json()) == (503, {"status": "draining"})
    assert live.status_code == 200


async def test_signal_keeps_listening_while_a_request_is_in_flight(fakes, redis_url, prefix,
                                                                   wait_until):
    """GatewayServer after SIGTERM: still serves probes (ready 503) while a request runs,
    and stops once it is done."""
    settings = GatewaySettings(port=0, tokenizer_address=fakes.address("tokenizer"),
                               engine_addresses=fakes.address("engine"),
                               detok_address=fakes.address("detok"), redis_url=redis_url,
                               redis_prefix=prefix, auth_enabled=False, drain_timeout_s=30)
    app = create_app(settings)
    release = asyncio.Event()

    @app.get("/test-slow")
    async def slow() -> dict:
        await release.wait()
        return {"done": True}

    server = GatewayServer(uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None,
                                          lifespan="on"), app, settings.drain_timeout_s)
    serving = asyncio.create_task(server.serve())
    await wait_until(lambda: server.started, timeout_s=5)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        in_flight = asyncio.create_task(client.get("/test-slow"))
        await wait_until(lambda: len(server.server_state.tasks) == 1, timeout_s=5)
        server.handle_exit(signal.SIGTERM, None)
        ready, live = await client.get("/ready"), await client.get("/live")
        assert (ready.status_code, live.status_code) == (503, 200)
        assert not serving.done()
        release.set()
        assert (await in_flight).json() == {"done": True}
    await asyncio.wait_for(serving, timeout=10)

