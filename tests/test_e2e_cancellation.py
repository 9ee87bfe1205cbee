"""Cancellation reaches the engine's allocator: a client that goes away leaves the
engine with no running request and a whole KV pool within a second."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

pytestmark = pytest.mark.slow

LONG = {"model": "smollm2-135m-instruct", "max_tokens": 400, "ignore_eos": True,
        "messages": [{"role": "user", "content": "Count from one to one thousand."}]}


async def _until_running(engine_client, timeout_s: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while (await engine_client.stats()).num_running == 0:
        assert loop.time() < deadline, "the request never started running"
        await asyncio.sleep(0.02)


async def test_closing_a_stream_after_a_few_chunks_frees_the_engine(stack, engine_client,
                                                                    idle_engine):
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client, \
            client.stream("POST", "/v1/chat/completions",
                          json={**LONG, "stream": True}) as response:
        assert response.status_code == 200
        num_chunks = 0
        async for line in response.aiter_lines():
            num_chunks += line.startswith("data: {")
            if num_chunks == 4:
                break
        assert (await engine_client.stats()).num_running == 1
    stats = await idle_engine(1.0)
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_blocks


async def test_non_streaming_client_that_goes_away_frees_the_engine(stack, engine_client,
                                                                     idle_engine):
    body = json.dumps(LONG).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", stack.gateway.port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: e2e\r\n"
                 b"Content-Type: application/json\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)
    await writer.drain()
    await _until_running(engine_client)
    await asyncio.sleep(0.3)  # let it generate a few tokens
    writer.close()
    await writer.wait_closed()
    stats = await idle_engine(1.0)
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_blocks


async def test_disconnects_are_counted(stack):
    async with httpx.AsyncClient(base_url=stack.base_url) as client:
        text = (await client.get("/metrics")).text
    counted = [line for line in text.splitlines()
               if line.startswith("conveyor_gateway_client_disconnects_total{")]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in counted) >= 1
