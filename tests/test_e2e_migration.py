"""A stream survives its engine's death: it moves to another engine mid-generation.

Two engines, eight greedy streams. One engine is SIGKILLed (its connection reset), or
SIGSTOPped (nothing resets it: the gateway's keepalive finds it), while it carries some
of them. Every stream still ends with its finish_reason and its full token count, none
gets an error event, usage counts every token once, the timeline records the move, and
the texts equal those of a run without the failure (greedy decoding).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal

import httpx
import pytest

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
MAX_TOKENS = 40
PROMPTS = [f"Write a short story about the number {i}." for i in range(8)]


def _body(prompt: str) -> dict:
    return {"model": MODEL, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": prompt}]}


@pytest.fixture
def pair(launch, stack):
    """Two engines registered under a prefix of their own and a gateway that sees them."""
    prefix = f"{stack.redis_prefix}:migration:{os.getpid()}"
    engines = launch.engines("mig-a", "mig-b", REDIS_PREFIX=prefix)
    gateway = launch.gateway("gateway-migration", CONVEYOR_GATEWAY_REDIS_PREFIX=prefix,
                             CONVEYOR_GATEWAY_ENGINE_ADDRESSES="",
                             CONVEYOR_GATEWAY_KEEPALIVE_TIME_S="1",
                             CONVEYOR_GATEWAY_KEEPALIVE_TIMEOUT_S="1")
    return f"http://127.0.0.1:{gateway.port}", {e.name: e for e in engines}


class Stream:
    """One streamed request as the client saw it."""

    def __init__(self) -> None:
        self.text = ""
        self.num_chunks = 0
        self.finish_reason: str | None = None
        self.usage: dict | None = None
        self.errors: list[dict] = []
        self.engine: str | None = None
        self.request_id: str | None = None


async def _stream(client: httpx.AsyncClient, prompt: str, started: asyncio.Event,
                  serving: list[str]) -> Stream:
    result = Stream()
    async with client.stream("POST", "/v1/chat/completions", json=_body(prompt)) as response:
        assert response.status_code == 200, await response.aread()
        result.engine = response.headers["x-conveyor-engine"]
        serving.append(result.engine)
        result.request_id = response.headers["x-request-id"]
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                result.errors.append(event["error"])
                continue
            for choice in event["choices"]:
                result.text += choice["delta"].get("content") or ""
                result.finish_reason = choice["finish_reason"] or result.finish_reason
            result.usage = event.get("usage") or result.usage
            result.num_chunks += 1
            if result.num_chunks >= 4:
                started.set()
    return result


async def _run(url: str, on_started=None) -> list[Stream]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        started, serving = asyncio.Event(), []
        tasks = [asyncio.create_task(_stream(client, p, started, serving)) for p in PROMPTS]
        if on_started is not None:
            await asyncio.wait_for(started.wait(), 120)
            await on_started(max(set(serving), key=serving.count))
        return await asyncio.gather(*tasks)


async def _check_moved(url: str, before: list[Stream], after: list[Stream]) -> None:
    for base, moved in zip(before, after, strict=True):
        assert moved.errors == [], moved.errors
        assert moved.finish_reason == "length"
        assert moved.usage["completion_tokens"] == MAX_TOKENS
        assert moved.text == base.text
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        timelines = [(await client.get(f"/v1/requests/{s.request_id}")).json() for s in after]
    moves = [t["num_moves"] for t in timelines]
    print("moves per stream:", moves, "engines:", [t["engine_id"] for t in timelines])
    assert any(moves), "no stream moved"
    assert all(t["finish_reason"] == "length" for t in timelines)


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
async def test_streams_survive_their_engine(pair, how):
    url, engines = pair
    before = await _run(url)  # the same streams, nothing failing
    victims = []

    async def fail_the_busiest_engine(engine_id: str) -> None:
        victims.append(engines[engine_id])
        os.kill(victims[0].pid, getattr(signal, how))

    try:
        after = await _run(url, fail_the_busiest_engine)
    finally:
        if victims and how == "SIGSTOP":
            os.kill(victims[0].pid, signal.SIGKILL)
    await _check_moved(url, before, after)
