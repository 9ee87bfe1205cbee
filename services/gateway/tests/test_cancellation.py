"""Cancellation: a client that goes away, a stop string or the deadline cancels the
engine stream; the race itself is tested on a fake ASGI receive."""

from __future__ import annotations

import asyncio
import json

import pytest

from conveyor.gateway.cancellation import ClientDisconnected, RequestTimedOut, race_client

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 100}


def disconnects(gateway, endpoint: str = "chat_completions") -> float:
    metrics = gateway.pipeline.metrics
    return metrics.client_disconnects.labels(endpoint)._value.get()


async def test_closing_a_stream_cancels_the_engine_request(gateway, wait_until):
    engine = gateway.fakes.engine
    engine.delay_s = 0.05
    async with gateway.client() as client, client.stream(
            "POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as response:
        seen = 0
        async for line in response.aiter_lines():
            seen += line.startswith("data: {")
            if seen == 3:
                break
    await wait_until(lambda: not engine.running and len(engine.cancelled) == 1)
    await wait_until(lambda: gateway.fakes.detok.streams_closed == 1)
    await wait_until(lambda: disconnects(gateway) == 1)


async def test_a_non_streaming_client_that_goes_away_cancels_the_engine(gateway, wait_until):
    engine = gateway.fakes.engine
    engine.delay_s = 0.05
    host, port = gateway.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    body = json.dumps(CHAT).encode()
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                 b"Content-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    await writer.drain()
    await wait_until(lambda: engine.running)
    writer.close()
    await wait_until(lambda: not engine.running and len(engine.cancelled) == 1)
    await wait_until(lambda: disconnects(gateway) == 1)


async def test_request_timeout_cancels_and_reports_504(gateway_factory, wait_until):
    gateway = await gateway_factory(request_timeout_s=0.3)
    engine = gateway.fakes.engine
    engine.delay_s = 0.05
    async with gateway.client() as client:
        response = await client.post("/v1/chat/completions", json=CHAT)
        streamed = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "request_timeout"
    lines = [line for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert json.loads(lines[-2][6:])["error"]["code"] == "request_timeout"
    assert lines[-1] == "data: [DONE]"
    await wait_until(lambda: not engine.running and len(engine.cancelled) == 2)


class FakeReceive:
    """An ASGI receive that reports a disconnect once `disconnect()` is called."""

    def __init__(self) -> None:
        self._gone = asyncio.Event()

    def disconnect(self) -> None:
        self._gone.set()

    async def __call__(self) -> dict:
        await self._gone.wait()
        return {"type": "http.disconnect"}


async def test_race_returns_the_work_result_and_stops_watching():
    receive = FakeReceive()
    deadline = asyncio.get_running_loop().time() + 5
    assert await race_client(asyncio.sleep(0, result=42), receive, deadline) == 42


async def test_race_cancels_the_work_when_the_client_goes_away():
    receive, cancelled = FakeReceive(), asyncio.Event()

    async def work():
        try:
            await asyncio.sleep(10)
        finally:
            cancelled.set()

    asyncio.get_running_loop().call_later(0.05, receive.disconnect)
    with pytest.raises(ClientDisconnected):
        await race_client(work(), receive, asyncio.get_running_loop().time() + 5)
    assert cancelled.is_set()


async def test_race_cancels_the_work_at_the_deadline():
    with pytest.raises(RequestTimedOut):
        await race_client(asyncio.sleep(10), FakeReceive(),
                          asyncio.get_running_loop().time() + 0.05)
