"""Concurrency, Poisson arrivals and the duration bound, against a fake server."""

import math
import time

import pytest

from bench.serving.runner import RunConfig, run_benchmark
from bench.serving.workload import BenchRequest
from bench.tests.fake_sse import FakeServer


def requests(num, max_tokens=4):
    return [BenchRequest(prompt="hello", prompt_len=7, max_tokens=max_tokens)
            for _ in range(num)]


async def test_fixed_concurrency_caps_requests_in_flight():
    server = FakeServer(first_delay_s=0.02, gap_s=0.005)
    config = RunConfig(base_url="http://fake", max_concurrency=3, num_warmup=0)
    m, results = await run_benchmark(requests(12), config, server.transport())
    assert m.completed == 12 and server.max_in_flight == 3
    assert m.total_output_tokens == 48
    assert all(b["ignore_eos"] and b["stream"] and b["max_tokens"] == 4 for b in server.bodies)


async def test_unbounded_concurrency_sends_everything_at_once():
    server = FakeServer(first_delay_s=0.05, gap_s=0.0)
    m, _ = await run_benchmark(requests(8), RunConfig(base_url="http://fake", num_warmup=0),
                               server.transport())
    assert m.completed == 8 and server.max_in_flight == 8


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


def test_config_url_and_headers():
    config = RunConfig(base_url="http://h:1/", api_key="k")
    assert config.url == "http://h:1/v1/completions"
    assert config.headers == {"Authorization": "Bearer k"}
    assert math.isinf(RunConfig(base_url="x").request_rate)


async def test_every_request_opens_its_own_connection():
    """No keep-alive: a pooled connection the server closed would fail the next request."""
    import asyncio

    connections = []

    async def handle(reader, writer):
        connections.append(writer)
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        body = (b'data: {"choices":[{"text":"a"}]}\n\n'
                b'data: {"choices":[],"usage":{"completion_tokens":1}}\n\ndata: [DONE]\n\n')
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
