"""Tokenizer and detok failover over real processes: two tokenizer and two detok
replicas registered in Redis, the stack's engine, and a gateway of their own.

- Calls spread over both replicas of each service; with one replica of each killed
  mid-run, every request still succeeds, and the dead ones stop getting calls.
- A replica that gets SIGTERM leaves the registry before it exits (not at its TTL).
- A detok stream whose replica dies mid-generation (SIGKILL: a reset; SIGSTOP: no
  reset, found by keepalive) is rebuilt on the other replica and the client gets
  the exact text, once.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import uuid

import httpx
import pytest
from redis.asyncio import Redis

from conveyor.common.service_registry import ReplicaEntry, ServiceRegistry
from devkit.replica_processes import MODEL, replica_calls, replica_process
from devkit.service_process import start_all, stop_all

pytestmark = pytest.mark.slow

SHORT = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4,
         "temperature": 0}
STREAM = {"model": MODEL, "prompt": "Count slowly: one, two, three,", "max_tokens": 40,
          "ignore_eos": True, "temperature": 0, "stream": True}


class Replicas:
    """Two tokenizers and two detoks registered under `prefix`, and a gateway over them."""

    def __init__(self, processes: dict, gateway):
        self.processes = processes
        self.url = f"http://127.0.0.1:{gateway.port}"
        self.gateway = gateway

    def address(self, name: str) -> str:
        return self.processes[name].address

    async def calls(self) -> dict[tuple[str, str], int]:
        async with httpx.AsyncClient(base_url=self.url, timeout=10) as client:
            return replica_calls((await client.get("/metrics")).text)

    async def calls_to(self, name: str) -> int:
        service = name.split("-")[0]
        return (await self.calls()).get((service, self.address(name)), 0)


@pytest.fixture
def replicas(stack, log_dir, extra_gateway):
    prefix = f"{stack.redis_prefix}:failover:{uuid.uuid4().hex[:8]}"
    names = ["tokenizer-a", "tokenizer-b", "detok-a", "detok-b"]
    processes = {name: replica_process(name.split("-")[0], f"{name}-failover", log_dir,
                                       stack.redis_url, prefix)
                 for name in names}
    start_all(list(processes.values()))
    try:
        gateway = extra_gateway(CONVEYOR_GATEWAY_REDIS_PREFIX=prefix,
                                CONVEYOR_GATEWAY_REPLICA_REFRESH_S="0.2")
        yield Replicas(processes, gateway)
    finally:
        for process in processes.values():
            if process.pid is not None and process.is_alive():
                os.kill(process.pid, signal.SIGCONT)
        stop_all(list(processes.values()))


async def complete(client: httpx.AsyncClient) -> str:
    response = await client.post("/v1/completions", json=SHORT)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


async def stream_text(client: httpx.AsyncClient, first_chunk: asyncio.Event | None = None):
    """The streamed text; sets `first_chunk` once text arrived."""
    parts = []
    async with client.stream("POST", "/v1/completions", json=STREAM) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            assert "error" not in chunk, chunk
            parts.append(chunk["choices"][0]["text"])
            if first_chunk is not None and parts[-1]:
                first_chunk.set()
    return "".join(parts)


async def wait_for(condition, timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.1)


async def test_calls_spread_and_survive_one_replica_of_each_killed(replicas):
    async with httpx.AsyncClient(base_url=replicas.url, timeout=120) as client:
        expected = await complete(client)

        async def every_replica_called():
            await complete(client)
            calls = await replicas.calls()
            return all(calls.get((n.split("-")[0], replicas.address(n)), 0) > 0
                       for n in replicas.processes)
        await wait_for(every_replica_called)

        running = [asyncio.create_task(complete(client)) for _ in range(4)]
        replicas.processes["tokenizer-a"].kill()
        replicas.processes["detok-a"].kill()
        texts = await asyncio.gather(*running)
        texts += [await complete(client) for _ in range(6)]
        assert texts == [expected] * 10

        async def dead_ones_left_out():
            before = [await replicas.calls_to(n) for n in ("tokenizer-a", "detok-a")]
            await complete(client)
            return before == [await replicas.calls_to(n) for n in ("tokenizer-a", "detok-a")]
        await wait_for(dead_ones_left_out, timeout_s=10)
    print(f"\nreplica calls after the kill: {await replicas.calls()}")


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
async def test_a_detok_stream_broken_mid_generation_yields_the_exact_text(replicas, how):
    async with httpx.AsyncClient(base_url=replicas.url, timeout=120) as client:
        expected = await stream_text(client)
        # Two streams at once: round robin puts one on each detok replica.
        started = [asyncio.Event(), asyncio.Event()]
        streams = [asyncio.create_task(stream_text(client, e)) for e in started]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
        os.kill(replicas.processes["detok-a"].pid, how)
        assert await asyncio.gather(*streams) == [expected, expected]
    assert "the generation resumes on another" in replicas.gateway.output()


async def test_replicas_leave_the_registry_on_sigterm(stack, log_dir):
    prefix = f"{stack.redis_prefix}:drain:{uuid.uuid4().hex[:8]}"
    processes = [replica_process(service, f"{service}-drain", log_dir, stack.redis_url, prefix,
                                 REGISTRY_TTL_S="600")
                 for service in ("tokenizer", "detok")]
    start_all(processes)
    redis = Redis.from_url(stack.redis_url, decode_responses=True)
    registries = [ServiceRegistry(redis, service=s, entry_type=ReplicaEntry, prefix=prefix)
                  for s in ("tokenizer", "detok")]
    try:
        listed = [[e.address for e in await r.list_live()] for r in registries]
        assert listed == [[p.address] for p in processes]
        await asyncio.gather(*(asyncio.to_thread(p.stop) for p in processes))
        assert [await r.list_live() for r in registries] == [[], []]  # TTL is 600 s
    finally:
        stop_all(processes)
        await redis.aclose()
