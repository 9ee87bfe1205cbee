"""A full waiting queue over a real gRPC channel: RESOURCE_EXHAUSTED with reason queue_full for
the refused and the pushed-out request, the others finish, Stats and /metrics count the shed."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from conveyor.common.errors import ERROR_REASON_KEY, QUEUE_FULL
from conveyor.engine.metrics import EngineMetrics
from conveyor.v1 import engine_pb2


@pytest.fixture
async def served(support):
    metrics = EngineMetrics("m", "e")
    core = support.make_core(max_model_len=64, max_num_seqs=1, max_num_waiting_seqs=1)
    async with support.serve_engine(core, metrics) as (engine, stub):
        yield engine, stub, metrics


def _generate(request_id, prompt, priority=0, max_tokens=4):
    return engine_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=prompt, priority=priority,
        sampling=engine_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens))


async def _tokens(stub, request):
    return [t for chunk in [c async for c in stub.Generate(request)] for t in chunk.token_ids]


async def _until(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


async def _refusal(task) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await task
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (ERROR_REASON_KEY, QUEUE_FULL) in tuple(caught.value.trailing_metadata())
    return caught.value


async def test_the_excess_is_refused_lowest_priority_first_and_the_rest_finish(served):
    engine, stub, metrics = served
    runner = engine.core.runner
    runner.step_gate = threading.Event()  # hold the loop in the first step of "run"
    run = asyncio.create_task(_tokens(stub, _generate("run", [1, 2, 3], max_tokens=6)))
    await _until(lambda: runner.num_steps == 1)
    tasks = {}
    for name, priority in [("low", 1), ("high", 0), ("late", 1)]:  # applied in this order
        tasks[name] = asyncio.create_task(_tokens(stub, _generate(name, [7, 8], priority)))
        num_streams = 1 + len(tasks)
        await _until(lambda: engine.num_streams == num_streams)  # noqa: B023 (awaited here)
    runner.step_gate.set()
    pushed_out = await _refusal(tasks["low"])
    assert pushed_out.details() == ("pushed out by a higher-priority request: the engine's "
                                    "waiting queue is full (1 requests / unlimited tokens); "
                                    "retry later")
    refused = await _refusal(tasks["late"])
    assert refused.details() == ("the engine's waiting queue is full (1 requests / unlimited "
                                 "tokens); retry later")
    assert await run == [4, 5, 6, 7, 8, 9] and await tasks["high"] == [9, 10, 11, 12]
    await _until(lambda: engine.stats().num_running == 0 and engine.num_streams == 0)
    stats = await stub.Stats(engine_pb2.EngineStatsRequest())
    assert (stats.num_requests_shed, stats.max_num_waiting_seqs) == (2, 1)
    assert (stats.max_num_waiting_tokens, stats.num_waiting_tokens, stats.num_waiting) == (0, 0, 0)
    assert stats.num_free_blocks == stats.num_blocks
    assert metrics.registry.get_sample_value(
        "conveyor:num_requests_shed_total", {"model_name": "m", "engine": "e"}) == 2
