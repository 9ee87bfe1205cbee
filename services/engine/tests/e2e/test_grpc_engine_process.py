"""A real engine process (`python -m conveyor.engine`) over real gRPC with the bundled model:
concurrent streams, a cancelled stream's blocks come back, bad requests are refused while
the others continue, Info, Stats and Prometheus metrics."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest

from conveyor.v1 import engine_pb2

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def engine_process(engine_launcher):
    process = engine_launcher(max_model_len=str(MAX_MODEL_LEN), engine_id="e2e-engine")
    yield process
    assert process.stop() == 0, process.output()


def _request(request_id, prompt, max_tokens=12, **sampling):
    params = {"temperature": 0.0, "max_tokens": max_tokens, **sampling}
    return engine_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=prompt,
                                      sampling=engine_pb2.SamplingParams(**params))


async def _collect(stub, request):
    chunks = [chunk async for chunk in stub.Generate(request)]
    return [t for c in chunks for t in c.token_ids], chunks[-1]


async def _pool_is_whole(stub, timeout_s=20.0) -> engine_pb2.EngineStats:
    for _ in range(int(timeout_s / 0.1)):
        stats = await stub.Stats(engine_pb2.EngineStatsRequest())
        if stats.num_running == 0 and stats.num_waiting == 0 and \
                stats.num_free_blocks == stats.num_blocks:
            return stats
        await asyncio.sleep(0.1)
    raise AssertionError(f"the pool did not come back: {stats}")


PROMPTS = [[504, 2988, 288, 451, 8170], [1, 2, 3, 4, 5, 6, 7, 8], [2000 + i for i in range(30)],
           [42] * 20]


async def test_info(stub):
    info = await stub.Info(engine_pb2.EngineInfoRequest())
    assert info.model == "smollm2-135m-instruct" and info.engine_id == "e2e-engine"
    assert info.max_model_len == MAX_MODEL_LEN and info.block_size == 16
    assert info.kv_capacity_tokens == info.num_blocks * 16 >= MAX_MODEL_LEN
    from conveyor.engine.attention.native_kernel import native_unavailable_reason
    # auto on the CPU: the native kernels where they build (or are cached), else torch; the
    # fixture pins float32 (dtype auto: test_cpu_paths.py)
    expected = "torch" if native_unavailable_reason() else "native"
    assert (info.attention_backend, info.dtype) == (expected, "float32")


async def test_concurrent_streams(stub):
    results = await asyncio.gather(*(_collect(stub, _request(f"c{i}", p))
                                     for i, p in enumerate(PROMPTS)))
    for tokens, last in results:
        assert last.finish_reason in (engine_pb2.FINISH_REASON_LENGTH,
                                      engine_pb2.FINISH_REASON_STOP)
        assert len(tokens) == last.usage.completion_tokens <= 12
    alone, _ = await _collect(stub, _request("again", PROMPTS[2]))
    assert alone == results[2][0]  # greedy: the same alone as in a batch
    await _pool_is_whole(stub)


async def test_cancelling_one_stream_returns_its_blocks(stub):
    others = [asyncio.create_task(_collect(stub, _request(f"k{i}", p)))
              for i, p in enumerate(PROMPTS[:3])]
    call = stub.Generate(_request("cancelled", [7] * 40, max_tokens=400, ignore_eos=True))
    num_chunks = 0
    async for _ in call:
        num_chunks += 1
        if num_chunks == 2:
            break
    call.cancel()
    for tokens, _ in await asyncio.gather(*others):
        assert tokens
    await _pool_is_whole(stub)


@pytest.mark.parametrize(("bad", "message"), [
    (_request("bad-temp", [1, 2, 3], temperature=-0.5), "temperature"),
    (_request("bad-empty", []), "empty"),
    (_request("bad-vocab", [1, 49152]), "out of range"),
    (_request("bad-long", [5] * 500, max_tokens=100), "max_model_len"),
], ids=["temperature", "empty", "vocab", "too-long"])
async def test_a_bad_request_is_refused_while_others_continue(stub, bad, message):
    good = [asyncio.create_task(_collect(stub, _request(f"g{i}-{bad.request_id}", p)))
            for i, p in enumerate(PROMPTS[:2])]
    await asyncio.sleep(0.3)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _collect(stub, bad)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in caught.value.details()
    for tokens, last in await asyncio.gather(*good):
        assert tokens and last.finish_reason != engine_pb2.FINISH_REASON_UNSPECIFIED


async def test_stats_and_prometheus_metrics(stub, engine_process):
    stats = await stub.Stats(engine_pb2.EngineStatsRequest())
    assert stats.num_blocks > 0 and stats.prefix_cache_hit_rate > 0.0
    url = f"http://127.0.0.1:{engine_process.metrics_port}/metrics"
    text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert f"vllm:{name}" in text
