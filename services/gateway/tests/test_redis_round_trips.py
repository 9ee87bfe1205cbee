"""The Redis budget of one streamed chat request (API keys on, caches warm): at most four
round trips, at most two of them before the first byte (docs/deployment.md, "Redis
round trips of one request"). Counted where redis-py writes to its sockets: one write of
packed commands (a command, a pipeline, a MULTI block) is one round trip."""

from __future__ import annotations

import re

import pytest
import redis.asyncio.connection as redis_connection

from conveyor.gateway.tenancy.api_keys import ApiKeyStore
from conveyor.gateway.tenancy.tiers import DEFAULT_TIERS

MAX_ROUND_TRIPS = 4
MAX_BEFORE_FIRST_BYTE = 2
PROMPT = "Tell me about the history of the printing press, in three sentences."
"""Long enough for prefix hints (the fake tokenizer gives one token per character)."""
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 5, "stream": True}
WARM = {"api_key_cache_ttl_s": 60, "engine_list_max_age_s": 60, "replica_refresh_s": 3600}
"""Caches that stay warm for the whole test, and replica refreshes out of the way."""


class RoundTrips:
    """Every write of commands to a Redis socket, as the commands' names."""

    def __init__(self, monkeypatch) -> None:
        self.sent: list[str] = []
        send = redis_connection.AbstractConnection.send_packed_command

        async def counted(connection, command, check_health=True):
            self.sent.append(_command_names(command))
            return await send(connection, command, check_health)

        monkeypatch.setattr(redis_connection.AbstractConnection, "send_packed_command",
                            counted)


def _command_names(packed) -> str:
    """'EVALSHA' or 'GETEX+MGET': the commands of one write (RESP arrays)."""
    data = b"".join(packed) if isinstance(packed, list | tuple) else bytes(packed)
    names = re.findall(rb"\*\d+\r\n\$\d+\r\n([A-Za-z]+)\r\n", data)
    return "+".join(name.decode().upper() for name in names)


@pytest.fixture
async def keyed(gateway_factory, redis, prefix):
    gateway = await gateway_factory(auth_enabled=True, **WARM)
    key = (await ApiKeyStore(redis, DEFAULT_TIERS, prefix=prefix).create("acme", "standard")).key
    return gateway, {"Authorization": f"Bearer {key}"}


async def _streamed_request(client, headers, trips: RoundTrips) -> tuple[list[str], list[str],
                                                                          str]:
    """(round trips before the first byte, all of them, the request id)."""
    trips.sent.clear()
    before_first_byte = None
    async with client.stream("POST", "/v1/chat/completions", json=CHAT,
                             headers=headers) as response:
        assert response.status_code == 200
        async for chunk in response.aiter_raw():
            if before_first_byte is None and chunk:
                before_first_byte = list(trips.sent)
        body_end = chunk
    assert body_end.endswith(b"data: [DONE]\n\n")
    return before_first_byte, list(trips.sent), response.headers["x-request-id"]


@pytest.mark.parametrize("session", ["none", "new", "bound"])
async def test_one_streamed_request_makes_at_most_four_redis_round_trips(
        keyed, monkeypatch, session):
    gateway, key_header = keyed
    headers = dict(key_header)
    async with gateway.client(headers=headers) as client:
        if session != "none":
            headers["X-Session-ID"] = f"conversation-{session}"
        warm = {**key_header, "X-Session-ID": "conversation-bound"} if session == "bound" \
            else key_header
        assert (await client.post("/v1/chat/completions", json=CHAT,
                                  headers=warm)).status_code == 200  # key cache, bindings
        trips = RoundTrips(monkeypatch)
        before, total, request_id = await _streamed_request(client, headers, trips)
        monkeypatch.undo()
        timeline = (await client.get(f"/v1/requests/{request_id}")).json()
    print(f"session {session}: before the first byte {before}, in all {total}")
    assert len(before) <= MAX_BEFORE_FIRST_BYTE, before
    assert len(total) <= MAX_ROUND_TRIPS, total
    assert None not in (timeline["arrival"], timeline["admitted"], timeline["queued"],
                        timeline["first_token"], timeline["finished"]), timeline
    assert timeline["finish_reason"] == "length"


async def test_a_running_requests_timeline_shows_its_arrival_and_admission(keyed, wait_until):
    gateway, headers = keyed
    gateway.fakes.engine.delay_s = 0.05
    async with gateway.client(headers=headers) as client:
        async with client.stream("POST", "/v1/chat/completions",
                                 json={**CHAT, "max_tokens": 20}) as response:
            request_id = response.headers["x-request-id"]
            running = (await client.get(f"/v1/requests/{request_id}")).json()
            async for _ in response.aiter_raw():
                pass
        finished = (await client.get(f"/v1/requests/{request_id}")).json()
    assert running["arrival"] is not None and running["admitted"] is not None
    assert running["num_prompt_tokens"] > 0 and running["finished"] is None
    assert finished["finished"] is not None and finished["num_completion_tokens"] == 20
