"""Cancellation: a client that goes away, a stop string or the deadline cancels the
engine stream; the lifeline itself is tested on a fake ASGI receive."""

from __future__ import annotations

import asyncio
import json

import pytest

from conveyor.gateway.errors import ClientDisconnected, RequestTimedOut
from conveyor.gateway.routes import Lifeline

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


async def test_closing_a_stream_of_n_choices_cancels_their_one_engine_call(gateway,
                                                                             wait_until):
    engine = gateway.fakes.engine
    engine.delay_s = 0.05
    async with gateway.client() as client, client.stream(
            "POST", "/v1/chat/completions", json={**CHAT, "n": 3, "stream": True}) as response:
        seen = set()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                seen.update(c["index"] for c in json.loads(line[6:])["choices"])
            if len(seen) == 3:
                break
    await wait_until(lambda: not engine.running and len(engine.cancelled) == 1)
    assert [r.n for r in engine.requests] == [3]
    await wait_until(lambda: gateway.fakes.detok.streams_closed == 1)


async def test_stop_strings_end_each_choice_of_a_shared_stream(gateway):
    async with gateway.client() as client:
        response = await client.post("/v1/chat/completions", json={
            **CHAT, "max_tokens": 8, "n": 2, "stop": ["th"]})
    choices = response.json()["choices"]
    assert [c["finish_reason"] for c in choices] == ["stop", "stop"]
    assert [c["message"]["content"] for c in choices] == [gateway.fakes.script[:6]] * 2
    assert len(gateway.fakes.engine.requests) == 1


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


async def test_the_lifeline_lets_work_that_finishes_return_and_stops_watching():
    receive = FakeReceive()
    async with Lifeline(receive, asyncio.get_running_loop().time() + 5) as lifeline:
        assert await asyncio.sleep(0, result=42) == 42
    assert lifeline.ended_by is None
    lifeline.check()


async def test_the_lifeline_cancels_the_task_when_the_client_goes_away():
    receive = FakeReceive()
    asyncio.get_running_loop().call_later(0.05, receive.disconnect)
    async with Lifeline(receive, asyncio.get_running_loop().time() + 5) as lifeline:
        with pytest.raises(asyncio.CancelledError):
            await asyncio.sleep(10)
    assert isinstance(lifeline.ended_by, ClientDisconnected)
    with pytest.raises(ClientDisconnected):
        lifeline.check()
    assert asyncio.current_task().cancelling() == 0  # the cancel was taken back
    await asyncio.sleep(0)  # and nothing is left pending


async def test_the_lifeline_cancels_the_task_at_the_deadline():
    async with Lifeline(FakeReceive(), asyncio.get_running_loop().time() + 0.05) as lifeline:
        with pytest.raises(asyncio.CancelledError):
            await asyncio.sleep(10)
    assert isinstance(lifeline.ended_by, RequestTimedOut)


async def test_a_swallowed_cancellation_still_ends_the_work_at_its_next_check():
    receive = FakeReceive()

    async def swallowing_call():
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            return "returned normally"  # what redis-py's asyncio client may do

    asyncio.get_running_loop().call_later(0.05, receive.disconnect)
    async with Lifeline(receive, asyncio.get_running_loop().time() + 5) as lifeline:
        assert await swallowing_call() == "returned normally"
        with pytest.raises(ClientDisconnected):
            lifeline.check()
    assert asyncio.current_task().cancelling() == 0
