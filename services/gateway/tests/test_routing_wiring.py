"""Which engine the gateway sends to: engines registered in Redis first, the static
list while none has registered, and around an engine it just failed to reach
(fake gRPC services, real Redis; the test writes the heartbeats engines would)."""

from __future__ import annotations

import pytest

from conveyor.common.engine_registry import EngineEntry, EngineLoad, EngineRegistry

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3}


@pytest.fixture
def register(redis, prefix):
    """`await register(engine_id, address)`: one heartbeat, as a live engine sends it."""
    registry = EngineRegistry(redis, prefix=prefix)

    async def beat(engine_id: str, address: str, num_running: int = 0) -> None:
        await registry.heartbeat(EngineEntry(engine_id, address, "fake-model",
                                             EngineLoad(num_running=num_running)))

    return beat


async def _engine_of(gateway, **headers) -> str:
    async with gateway.client() as client:
        response = await client.post("/v1/chat/completions", json=CHAT, headers=headers)
    assert response.status_code == 200, response.text
    return response.headers["x-conveyor-engine"]


async def test_the_static_list_stands_in_while_no_engine_registered(gateway):
    # The fake engine's Info names no id, so its address is its id.
    assert await _engine_of(gateway) == gateway.fakes.address("engine")
    async with gateway.client() as client:
        health = (await client.get("/health")).json()
    assert health == {"status": "ok", "num_engines": 1}


async def test_registered_engines_replace_the_static_list(gateway_factory, register):
    gateway = await gateway_factory(engine_addresses="")
    await register("registered-1", gateway.fakes.address("engine"))
    assert await _engine_of(gateway) == "registered-1"


async def test_an_unreachable_engine_is_routed_around(gateway_factory, register, caplog):
    gateway = await gateway_factory(engine_addresses="")
    await register("a-dead", "127.0.0.1:1")  # preferred: same load, smaller id
    await register("b-alive", gateway.fakes.address("engine"), num_running=0)
    session = {"X-Session-ID": "conversation-1"}
    assert await _engine_of(gateway, **session) == "b-alive"
    assert await _engine_of(gateway, **session) == "b-alive"
    assert len(gateway.fakes.engine.requests) == 2
    routed_around = [r for r in caplog.records if "a-dead" in r.getMessage()
                     and ("trying another" in r.getMessage() or "moves to" in r.getMessage())]
    assert len(routed_around) == 1 and "a-dead" in routed_around[0].getMessage()


async def test_no_engine_anywhere_is_503(gateway_factory):
    gateway = await gateway_factory(engine_addresses="")
    async with gateway.client() as client:
        response = await client.post("/v1/chat/completions", json=CHAT)
        health = await client.get("/health")
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "no_engine_available"
    assert health.json()["down"] == ["engine"]
