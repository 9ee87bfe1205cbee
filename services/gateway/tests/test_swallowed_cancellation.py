"""A Redis call that swallows the request's cancellation leaks nothing.

redis-py's asyncio client may catch a task's CancelledError in the middle of a command
and return normally. Here each Redis call of the request path in turn does exactly
that: the client hangs up while the call is in flight, the call takes the cancellation
and completes as if nothing happened. The request must still end at its next check,
cancel the engine stream, settle its quota (the tier allows one concurrent request, so
the next request would be refused otherwise) and give its timeline an end state.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import redis.asyncio.client as redis_client

from conveyor.common.log import request_id_var
from conveyor.gateway.tenancy.api_keys import ApiKeyStore
from conveyor.gateway.tenancy.tiers import build_tiers

TIERS = {"one-at-a-time": {"priority": 10, "requests_per_minute": None,
                           "tokens_per_minute": None, "max_concurrent_requests": 1}}
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 20, "stream": True}


class SwallowingRedis:
    """Counts the Redis calls made on behalf of a request (commands, pipelines); the
    call numbered `swallow_at` hangs up the client, takes the cancellation and then
    completes normally."""

    def __init__(self, monkeypatch) -> None:
        self.calls: list[str] = []
        self.swallow_at: int | None = None
        self.hang_up = None
        self.request_task: asyncio.Task | None = None
        self.swallowed = asyncio.Event()
        for cls, name in ((redis_client.Redis, "execute_command"),
                          (redis_client.Pipeline, "execute")):
            monkeypatch.setattr(cls, name, self._wrap(getattr(cls, name), name))

    def _wrap(self, call, name):
        async def wrapped(client, *args, **kwargs):
            if not self._is_the_requests_own(asyncio.current_task()):
                return await call(client, *args, **kwargs)
            self.calls.append(" ".join(map(str, args[:2])) if args else name)
            if len(self.calls) - 1 == self.swallow_at:
                await self._take_the_cancellation()
            return await call(client, *args, **kwargs)

        return wrapped

    def _is_the_requests_own(self, task: asyncio.Task) -> bool:
        """A call the request's task makes (not a background refresh it started, nor
        its cleanup, which runs shielded in a task of its own)."""
        if request_id_var.get() is None or self.hang_up is None:
            return False
        if self.request_task is None or self.request_task.done():
            self.request_task = task
        return task is self.request_task

    async def _take_the_cancellation(self) -> None:
        self.hang_up()
        try:
            await asyncio.sleep(2)  # the client's disconnect cancels the request here
        except asyncio.CancelledError:
            self.swallowed.set()  # ... and, like redis-py at times, we carry on


@pytest.fixture
async def keyed(gateway_factory, redis, prefix):
    gateway = await gateway_factory(auth_enabled=True, tiers=TIERS,
                                    api_key_cache_ttl_s=0)  # the key lookup is a call too
    store = ApiKeyStore(redis, build_tiers(TIERS), prefix=prefix)
    key = (await store.create("acme", "one-at-a-time")).key
    return gateway, {"Authorization": f"Bearer {key}", "X-Session-ID": "conversation-1"}


async def _request_until_hung_up(gateway, headers, swallowing: SwallowingRedis) -> None:
    """Send a request on a raw connection; `hang_up` drops the connection."""
    host, port = gateway.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    body = json.dumps(CHAT).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n{head}Content-Type: "
                 f"application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    swallowing.hang_up = writer.transport.abort
    await writer.drain()
    await reader.read()  # until the server ends the response or the connection drops
    swallowing.hang_up = None
    writer.close()


def _num_finished(gateway) -> float:
    """Generation requests the gateway has finished (any status)."""
    counter = gateway.pipeline.metrics.requests
    return sum(sample.value for metric in counter.collect() for sample in metric.samples
               if sample.name.endswith("_total"))


async def _assert_nothing_left(gateway, headers, redis, prefix, wait_until) -> None:
    engine = gateway.fakes.engine
    await wait_until(lambda: not engine.running, timeout_s=5)
    slots = f"{prefix}:quota:{{acme}}:concurrency"
    deadline = asyncio.get_running_loop().time() + 5
    while await redis.zcard(slots) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.02)
    assert await redis.zcard(slots) == 0, "the concurrency slot leaked"
    timelines = [await redis.hgetall(k) async for k in redis.scan_iter(f"{prefix}:timeline:*")]
    assert all("finished" in t for t in timelines), timelines  # none before authentication
    async with gateway.client(headers=headers) as client:  # the one slot is free again
        response = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2})
    assert response.status_code == 200, response.text


async def test_each_redis_call_that_swallows_the_cancellation_leaks_nothing(
        keyed, redis, prefix, monkeypatch, wait_until):
    gateway, headers = keyed
    gateway.fakes.engine.delay_s = 0.05
    swallowing = SwallowingRedis(monkeypatch)
    async with gateway.client(headers=headers) as client:  # warm: engine list, bindings
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200

    swallowing.hang_up = lambda: None  # count the calls a request makes, hanging up none
    async with gateway.client(headers=headers) as client:
        await client.post("/v1/chat/completions", json=CHAT)
    swallowing.hang_up, calls = None, list(swallowing.calls)
    print(f"Redis calls of one request: {calls}")
    assert len(calls) >= 3  # the key, the admission (with the timeline), the bindings

    swallowed = []
    for index in range(len(calls)):
        swallowing.calls, swallowing.swallow_at = [], index
        swallowing.swallowed.clear()
        num_finished = _num_finished(gateway)
        await _request_until_hung_up(gateway, headers, swallowing)
        await wait_until(lambda n=num_finished: _num_finished(gateway) > n, timeout_s=10)
        if swallowing.swallowed.is_set():
            swallowed.append(calls[index])
        await _assert_nothing_left(gateway, headers, redis, prefix, wait_until)
        await redis.delete(*[k async for k in redis.scan_iter(f"{prefix}:timeline:*")] or
                           [f"{prefix}:none"])
    print(f"swallowed at: {swallowed}")
    assert swallowed == calls  # each call took the cancellation in its turn
