"""Timing one streamed request against a fake SSE server."""

import httpx
import pytest

from bench.serving.client import ChunkTimer, RequestResult, parse_sse_line, send_completion
from bench.tests.fakes import FakeServer


async def send(server: FakeServer, max_tokens: int) -> RequestResult:
    async with httpx.AsyncClient(transport=server.transport()) as client:
        return await send_completion(client, "http://fake/v1/completions",
                                     {"prompt": "x", "max_tokens": max_tokens}, 7)


async def test_ttft_itl_and_tokens_from_the_stream():
    r = await send(FakeServer(first_delay_s=0.1, gap_s=0.02), 5)
    assert r.success and r.output_tokens == 5
    assert r.ttft >= 0.1  # the first chunk's, not the stream's end: four gaps follow it
    assert len(r.itl) == 4 and all(g >= 0.015 for g in r.itl)
    assert r.latency == pytest.approx(r.ttft + sum(r.itl))
    assert r.prompt_tokens_reported == 7


async def test_without_usage_each_chunk_is_one_token_and_an_http_error_fails():
    r = await send(FakeServer(first_delay_s=0, gap_s=0, send_usage=False), 3)
    assert r.success and r.output_tokens == 3
    r = await send(FakeServer(status=429), 3)
    assert not r.success and r.error.startswith("HTTP 429")


def test_usage_chunk_is_not_a_token_event_and_no_token_is_a_failure():
    r = RequestResult(prompt_len=1)
    timer = ChunkTimer(r, start=10.0)
    timer.on_event({"choices": [{"text": "a"}]}, 10.5)
    timer.on_event({"choices": [{"text": "b"}]}, 10.7)
    timer.on_event({"choices": [], "usage": {"completion_tokens": 4}}, 11.5)
    timer.finish()
    assert (r.ttft, r.itl, r.latency, r.output_tokens) == (0.5, [pytest.approx(0.2)],
                                                           pytest.approx(0.7), 4)
    assert not ChunkTimer(RequestResult(prompt_len=1), 0.0).finish().success


def test_parse_sse_line():
    assert parse_sse_line('data: {"a": 1}') == {"a": 1}
    assert [parse_sse_line(line) for line in ("data: [DONE]", ": keep-alive", "")] == [None] * 3
