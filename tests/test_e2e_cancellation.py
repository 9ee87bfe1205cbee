"""Cancellation reaches the engine's allocator: a client that goes away leaves the
engine with no running request and a whole KV pool (within a second on an idle machine;
the tests wait on that condition with a deadline, so they pass with the cores busy)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

pytestmark = pytest.mark.slow

IDLE_DEADLINE_S = 30.0
"""How long the engine may take to become idle again; a leak never does."""
LONG = {"model": "smollm2-135m-instruct", "max_tokens": 400, "ignore_eos": True,
        "messages": [{"role": "user", "content": "Count from one to one thousand."}]}


async def _until_running(engine_client, timeout_s: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while (await engine_client.stats()).num_running == 0:
        assert loop.time() < deadline, "the request never started running"
        await asyncio.sleep(0.02)


async def _until_decoding(engine_client, timeout_s: float = 60.0) -> None:
    """Until the running request holds one KV block more than its prompt did (it has
    generated tokens); the Stats snapshot lags the stream, so poll it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    first = None
    while True:
        stats = await engine_client.stats()
        in_use = stats.num_blocks - stats.num_free_blocks
        if stats.num_running and first is not None and in_use > first:
            return
        if stats.num_running and first is None:
            first = in_use
        assert loop.time() < deadline, "the request never generated a block's worth of tokens"
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
        await _until_running(engine_client)  # Stats is a snapshot of the last step: poll it
    stats = await idle_engine(IDLE_DEADLINE_S)
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_blocks


async def test_non_streaming_client_that_goes_away_frees_the_engine(stack, engine_client,
                                                                     idle_engine):
    body = json.dumps(LONG).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", stack.processes["gateway"].port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: e2e\r\n"
                 b"Content-Type: application/json\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)
    await writer.drain()
    await _until_decoding(engine_client)
    writer.close()
    await writer.wait_closed()
    stats = await idle_engine(IDLE_DEADLINE_S)
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_blocks


async def test_disconnects_are_counted(stack):
    async with httpx.AsyncClient(base_url=stack.base_url) as client:
        text = (await client.get("/metrics")).text
    counted = [line for line in text.splitlines()
               if line.startswith("conveyor_gateway_client_disconnects_total{")]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in counted) >= 1
