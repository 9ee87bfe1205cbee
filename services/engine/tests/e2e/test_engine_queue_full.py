"""A real engine process with a bounded waiting queue (max_num_seqs=1, max_num_waiting_seqs=2):
a burst of two priorities over real gRPC sheds the excess with RESOURCE_EXHAUSTED / queue_full,
the lower priority first, every other request finishes, and the engine ends idle and whole."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import grpc
import pytest

from conveyor.common.errors import ERROR_REASON_KEY, QUEUE_FULL
from conveyor.v1 import engine_pb2

pytestmark = pytest.mark.slow

BLOCKER_TOKENS = 300
"""Long enough to hold the one running slot while the burst arrives (seconds on a CPU)."""
TOP, HIGH, LOW = 0, 1, 2


@pytest.fixture(scope="module")
def engine_process(engine_launcher):
    process = engine_launcher(max_model_len="512", kv_cache_gib="0.05", max_num_seqs="1",
                              max_num_waiting_seqs="2", redis_url="")
    yield process
    assert process.stop() == 0, process.output()


def _request(request_id, prompt, priority, max_tokens=4, **sampling):
    return engine_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=prompt, priority=priority,
        sampling=engine_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, **sampling))


async def _collect(stub, request):
    chunks = [chunk async for chunk in stub.Generate(request)]
    return [t for c in chunks for t in c.token_ids], chunks[-1].finish_reason


def _start(stub, request) -> asyncio.Task:
    return asyncio.create_task(_collect(stub, request))


async def _stats_until(stub, predicate, timeout_s=30.0) -> engine_pb2.EngineStats:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = await stub.Stats(engine_pb2.EngineStatsRequest())
        if predicate(stats):
            return stats
        assert time.monotonic() < deadline, f"condition not reached: {stats}"
        await asyncio.sleep(0.05)


async def _shed(task) -> str:
    """The task's stream ended with RESOURCE_EXHAUSTED / queue_full; its message."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await task
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, caught.value
    assert (ERROR_REASON_KEY, QUEUE_FULL) in tuple(caught.value.trailing_metadata())
    return caught.value.details()


async def test_a_burst_past_the_bound_sheds_the_lower_priority_first(stub, engine_process):
    blocker = _start(stub, _request("blocker", [7] * 8, TOP, BLOCKER_TOKENS, ignore_eos=True))
    await _stats_until(stub, lambda s: s.num_running == 1)
    low = [_start(stub, _request(f"low{i}", [300 + i] * 10, LOW)) for i in range(2)]
    await _stats_until(stub, lambda s: s.num_waiting == 2 and s.num_waiting_tokens == 20)
    pushed_out = "pushed out by a higher-priority request: the engine's waiting queue is full"
    high = [_start(stub, _request("high0", [400] * 6, HIGH))]
    assert (await _shed(low[1])).startswith(pushed_out)  # the latest of the lowest goes first
    high.append(_start(stub, _request("high1", [401] * 6, HIGH)))
    assert (await _shed(low[0])).startswith(pushed_out)
    for name, priority in [("high2", HIGH), ("low2", LOW)]:  # nobody waiting ranks below
        message = await _shed(_start(stub, _request(name, [500] * 6, priority)))
        assert message == ("the engine's waiting queue is full (2 requests / 16384 tokens); "
                           "retry later")
    assert not blocker.done(), "the blocker ended before the burst was shed"
    tokens, finish = await blocker
    assert (len(tokens), finish) == (BLOCKER_TOKENS, engine_pb2.FINISH_REASON_LENGTH)
    for tokens, finish in await asyncio.gather(*high):
        assert len(tokens) == 4 and finish == engine_pb2.FINISH_REASON_LENGTH
    stats = await _stats_until(stub, lambda s: s.num_running == s.num_waiting == 0
                               and s.num_free_blocks == s.num_blocks)
    assert (stats.num_requests_shed, stats.num_waiting_tokens) == (4, 0)
    assert (stats.max_num_waiting_seqs, stats.max_num_waiting_tokens) == (2, 16384)
    url = f"http://127.0.0.1:{engine_process.metrics_port}/metrics"
    text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
    assert 'conveyor:num_requests_shed_total{engine="' in text
    assert any(line.startswith("conveyor:num_requests_shed_total{") and line.endswith(" 4.0")
               for line in text.splitlines())
