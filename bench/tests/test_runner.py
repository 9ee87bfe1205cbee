"""Concurrency, Poisson arrivals and the duration bound, against a fake server."""

import asyncio
import re
import time

import pytest

from bench.serving.runner import RunConfig, run_benchmark
from bench.serving.workload import BenchRequest
from bench.tests.fakes import FakeServer, chunk, usage_chunk


def requests(num, max_tokens=4):
    return [BenchRequest(prompt="hello", prompt_len=7, max_tokens=max_tokens)
            for _ in range(num)]


@pytest.mark.parametrize("max_concurrency, max_in_flight", [(3, 3), (None, 12)])
async def test_concurrency_caps_requests_in_flight(max_concurrency, max_in_flight):
    server = FakeServer(first_delay_s=0.05, gap_s=0.005)
    config = RunConfig(base_url="http://fake/", max_concurrency=max_concurrency, num_warmup=0,
                       api_key="k")
    m, _ = await run_benchmark(requests(12), config, server.transport())
    assert m.completed == 12 and server.max_in_flight == max_in_flight
    assert m.total_output_tokens == 48
    assert all(b["ignore_eos"] and b["stream"] and b["max_tokens"] == 4 for b in server.bodies)
    assert {(str(r.url), r.headers["authorization"]) for r in server.requests} == {
        ("http://fake/v1/completions", "Bearer k")}


async def test_poisson_rate_spreads_sends():
    server = FakeServer(first_delay_s=0.0, gap_s=0.0)
    config = RunConfig(base_url="http://fake", request_rate=50.0, num_warmup=0, seed=1)
    start = time.perf_counter()
    _, results = await run_benchmark(requests(20), config, server.transport())
    spread = max(r.start_time for r in results) - min(r.start_time for r in results)
    assert 0.1 < spread < 2.0  # 19 gaps of mean 20 ms
    assert time.perf_counter() - start < 5


async def test_duration_stops_issuing_new_requests():
    server = FakeServer(first_delay_s=0.1, gap_s=0.0)
    config = RunConfig(base_url="http://fake", max_concurrency=2, duration_s=0.15,
                       num_warmup=0)
    m, results = await run_benchmark(requests(50), config, server.transport())
    assert 2 <= m.completed <= 6 and len(results) == m.completed


async def test_warm_up_is_not_measured_and_fails_loudly():
    server = FakeServer(first_delay_s=0.0, gap_s=0.0)
    m, _ = await run_benchmark(requests(3), RunConfig(base_url="http://fake", num_warmup=1),
                               server.transport())
    assert len(server.bodies) == 4 and m.completed == 3
    with pytest.raises(RuntimeError, match="warm-up"):
        await run_benchmark(requests(3), RunConfig(base_url="http://fake"),
                            FakeServer(status=500).transport())


async def test_every_request_opens_its_own_connection():
    """No keep-alive: a pooled connection the server closed would fail the next request."""
    connections = []

    async def handle(reader, writer):
        connections.append(writer)
        head = await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(int(re.search(rb"(?i)content-length: *(\d+)", head)[1]))
        body = chunk("a", "length") + usage_chunk(1, 1) + b"data: [DONE]\n\n"
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        await reader.read(1)  # the client's close, or a second request on this connection
        writer.close()  # either way this connection answers no more

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        config = RunConfig(base_url=f"http://127.0.0.1:{port}", max_concurrency=1,
                           num_warmup=0)
        m, _ = await run_benchmark(requests(3, max_tokens=1), config)
    assert m.completed == 3 and len(connections) == 3
