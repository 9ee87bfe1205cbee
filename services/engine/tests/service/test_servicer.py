"""The Engine gRPC service in process, over a real channel, with the fake runner underneath."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from conveyor.common.errors import CONTEXT_LENGTH_EXCEEDED, ERROR_REASON_KEY, INVALID_REQUEST
from conveyor.common.grpc_client import open_channel
from conveyor.common.grpc_server import ServiceRegistration, start_grpc_server
from conveyor.common.settings import ServiceSettings
from conveyor.engine.async_engine import AsyncEngine
from conveyor.engine.servicer import SERVICE_NAME, EngineServicer
from conveyor.v1 import engine_pb2, engine_pb2_grpc


@pytest.fixture
async def served(support):
    engine = AsyncEngine(support.make_core(max_model_len=64)).start()
    registration = ServiceRegistration(
        SERVICE_NAME, engine_pb2_grpc.add_EngineServicer_to_server, EngineServicer(engine))
    service = await start_grpc_server(ServiceSettings(port=0), [registration])
    channel = open_channel(f"127.0.0.1:{service.port}")
    yield engine, engine_pb2_grpc.EngineStub(channel)
    await channel.close()
    await service.server.stop(grace=None)
    engine.shutdown()


def _generate(request_id, prompt, max_tokens=4, **sampling):
    return engine_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=prompt,
        sampling=engine_pb2.SamplingParams(**{"temperature": 0.0, "max_tokens": max_tokens,
                                              **sampling}))


async def _tokens(stub, request):
    chunks = [chunk async for chunk in stub.Generate(request)]
    return [t for c in chunks for t in c.token_ids], chunks[-1]


async def _wait_until(predicate, timeout_s=5.0):
    for _ in range(int(timeout_s / 0.01)):
        if await predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


async def test_generate_streams_tokens_and_finishes_with_usage(served):
    _, stub = served
    tokens, last = await _tokens(stub, _generate("a", [1, 2, 3], max_tokens=4, logprobs=True,
                                                 top_logprobs=2))
    assert tokens == [4, 5, 6, 7]
    assert last.finish_reason == engine_pb2.FINISH_REASON_LENGTH
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (3, 4)
    assert last.logprobs[0].logprob == pytest.approx(-0.25)
    assert [t.token_id for t in last.logprobs[0].top] == [1, 2]


async def test_stop_token_id_is_reported(served):
    engine, stub = served
    engine.core.runner.eos_after = 1
    _, last = await _tokens(stub, _generate("a", [1, 2], max_tokens=5))
    assert last.finish_reason == engine_pb2.FINISH_REASON_STOP
    assert last.HasField("stop_token_id") and last.stop_token_id == 99


async def test_unset_max_tokens_fills_the_context(served):
    _, stub = served
    tokens, last = await _tokens(stub, _generate("a", [1, 2], max_tokens=0))
    assert len(tokens) == 62 and last.finish_reason == engine_pb2.FINISH_REASON_LENGTH


@pytest.mark.parametrize(("request_", "reason", "message"), [
    (_generate("e", []), INVALID_REQUEST, "must not be empty"),
    (_generate("v", [1, 100]), INVALID_REQUEST, "out of range"),
    (_generate("t", [1], temperature=-1.0), INVALID_REQUEST, "temperature"),
    (_generate("p", [1], top_p=1.5), INVALID_REQUEST, "top_p"),
    (_generate("l", list(range(1, 50)), max_tokens=20), CONTEXT_LENGTH_EXCEEDED, "max_model_len"),
])
async def test_bad_requests_are_invalid_argument(served, request_, reason, message):
    _, stub = served
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _tokens(stub, request_)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in caught.value.details()
    assert (ERROR_REASON_KEY, reason) in tuple(caught.value.trailing_metadata())


async def test_model_error_is_internal_and_others_continue(served):
    engine, stub = served
    engine.core.runner.fail_on = 50
    good = asyncio.create_task(_tokens(stub, _generate("good", [1, 2], max_tokens=6)))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _tokens(stub, _generate("bad", [50, 51]))
    assert caught.value.code() == grpc.StatusCode.INTERNAL
    assert "injected model failure" in caught.value.details()
    assert (await good)[0] == [3, 4, 5, 6, 7, 8]


async def test_cancelled_stream_is_aborted_and_the_pool_comes_back(served):
    engine, stub = served
    engine.core.runner.step_gate = gate = threading.Event()
    call = stub.Generate(_generate("c", [1, 2, 3], max_tokens=50))
    other = asyncio.create_task(_tokens(stub, _generate("o", [9, 8], max_tokens=5)))

    async def both_running():
        return engine.num_streams == 2

    await _wait_until(both_running)
    call.cancel()
    gate.set()
    assert (await other)[0] == [9, 10, 11, 12, 13]

    async def pool_whole():
        stats = await stub.Stats(engine_pb2.EngineStatsRequest())
        return stats.num_free_blocks == stats.num_blocks and stats.num_running == 0

    await _wait_until(pool_whole)
    assert not engine.core.has_unfinished_requests


async def test_info_and_stats(served):
    _, stub = served
    info = await stub.Info(engine_pb2.EngineInfoRequest())
    assert (info.model, info.max_model_len, info.block_size, info.num_blocks) == (
        "fake", 64, 4, 64)
    assert info.kv_capacity_tokens == 256 and info.engine_id == "test-engine"
    await _tokens(stub, _generate("a", list(range(1, 10)), max_tokens=2))
    await _tokens(stub, _generate("b", list(range(1, 10)), max_tokens=2))
    stats = await stub.Stats(engine_pb2.EngineStatsRequest())
    assert stats.num_blocks == 64 and stats.kv_usage == 0.0
    assert 0.0 < stats.prefix_cache_hit_rate < 1.0


async def test_prompt_logprobs_travel_on_the_first_chunk(served):
    _, stub = served
    chunks = [c async for c in stub.Generate(_generate("p", [5, 6, 7], prompt_logprobs=1))]
    assert [len(c.prompt_logprobs) for c in chunks] == [2] + [0] * (len(chunks) - 1)
    first, second = chunks[0].prompt_logprobs
    assert (first.rank, second.rank) == (1, 2)
    assert first.logprob == pytest.approx(-0.06)
    assert [(t.token_id, t.logprob) for t in second.top] == [(7, pytest.approx(-0.07))]


async def test_prompt_logprobs_out_of_range_is_invalid_argument(served):
    _, stub = served
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _tokens(stub, _generate("p", [5, 6, 7], prompt_logprobs=21))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_logprobs" in caught.value.details()


async def test_usage_carries_the_samples_draft_counts(support):
    """After the prefill samples 3, the prompt's 1, 2, 3 proposes 4, 9, 9, 1; the fake
    samples 4, 5: one accepted. No later n-gram of the output is in the prompt."""
    core = support.make_core(max_model_len=64, num_speculative_tokens=4)
    async with support.serve_engine(core) as (_, stub):
        chunks = [c async for c in stub.Generate(_generate("a", [1, 2, 3, 4, 9, 9, 1, 2],
                                                           max_tokens=6))]
    assert [t for c in chunks for t in c.token_ids] == [3, 4, 5, 6, 7, 8]
    assert [(c.usage.draft_tokens, c.usage.accepted_draft_tokens) for c in chunks] == [
        (0, 0), (4, 1), (4, 1), (4, 1), (4, 1)]
