"""LoRA through a real engine process over gRPC: a Generate naming an adapter the engine
does not hold reads it and streams what the offline engine gives; LoadLoraAdapter and
UnloadLoraAdapter; Stats lists the adapters held; vllm:lora_requests_info; bad adapters
and an engine with LoRA off are refused with a status that says why."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest

from conveyor.common.grpc_client import open_channel
from conveyor.engine import LLM, LoRARequest, SamplingParams
from conveyor.v1 import engine_pb2, engine_pb2_grpc

pytestmark = pytest.mark.slow

PROMPT = [504, 2988, 288, 451, 8170, 314]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def adapter(make_lora_adapter) -> str:
    return make_lora_adapter.make(8, seed=5)


@pytest.fixture(scope="module")
def engine_process(engine_launcher):
    process = engine_launcher(max_model_len="512", enable_lora="true", max_loras="2",
                              max_lora_rank="8")
    yield process
    assert process.stop() == 0, process.output()


@pytest.fixture(scope="module")
def offline_tokens(adapter, engine_test_support) -> dict[str | None, list[int]]:
    llm = LLM(engine_test_support.model, dtype="float32", max_model_len=512, kv_cache_gib=0.1,
              torch_threads=engine_test_support.torch_threads, enable_lora=True, max_lora_rank=8)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([PROMPT, PROMPT], params,
                           lora_request=[LoRARequest("tuned", 1, adapter), None])
    return {"tuned": outputs[0].outputs[0].token_ids, None: outputs[1].outputs[0].token_ids}


def _request(request_id: str, lora: engine_pb2.LoraAdapter | None = None):
    sampling = engine_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return engine_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=PROMPT,
                                      sampling=sampling, lora=lora)


async def _tokens(stub, request) -> list[int]:
    return [t async for chunk in stub.Generate(request) for t in chunk.token_ids]


async def test_generate_reads_the_adapter_and_matches_the_offline_engine(
        stub, adapter, offline_tokens):
    info = await stub.Info(engine_pb2.EngineInfoRequest())
    assert (info.max_loras, info.max_lora_rank) == (2, 8)
    tuned = engine_pb2.LoraAdapter(name="tuned", path=adapter)
    base, with_adapter = await asyncio.gather(_tokens(stub, _request("base")),
                                              _tokens(stub, _request("tuned", tuned)))
    assert with_adapter == offline_tokens["tuned"] != base == offline_tokens[None]
    stats = await stub.Stats(engine_pb2.EngineStatsRequest())
    assert list(stats.lora_adapters) == ["tuned"]


async def test_load_and_unload(stub, adapter, engine_process):
    info = await stub.LoadLoraAdapter(engine_pb2.LoraAdapter(name="other", path=adapter))
    assert info.rank == 8 and "q_proj" in info.target_modules
    stats = await stub.Stats(engine_pb2.EngineStatsRequest())
    assert "other" in stats.lora_adapters
    await stub.UnloadLoraAdapter(engine_pb2.LoraAdapter(name="other"))
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stub.UnloadLoraAdapter(engine_pb2.LoraAdapter(name="other"))
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
    stats = await stub.Stats(engine_pb2.EngineStatsRequest())
    assert "other" not in stats.lora_adapters
    metrics = urllib.request.urlopen(
        f"http://127.0.0.1:{engine_process.metrics_port}/metrics").read().decode()
    assert 'vllm:lora_requests_info{engine=' in metrics and 'max_lora="2"' in metrics


async def test_bad_adapters_are_invalid_argument(stub, make_lora_adapter, tmp_path):
    too_big = make_lora_adapter.make(16, seed=6)
    for path, message in ((too_big, "rank 16"), (str(tmp_path), "cannot read")):
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.LoadLoraAdapter(engine_pb2.LoraAdapter(name="bad", path=path))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in error.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await _tokens(stub, _request("bad", engine_pb2.LoraAdapter(name="bad", path=path)))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in error.value.details()
    stats = await stub.Stats(engine_pb2.EngineStatsRequest())
    assert stats.num_running == stats.num_waiting == 0 and "bad" not in stats.lora_adapters


async def test_an_engine_with_lora_off_refuses_adapters(engine_launcher, adapter):
    process = engine_launcher(max_model_len="512")
    try:
        channel = open_channel(process.address)
        stub = engine_pb2_grpc.EngineStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.LoadLoraAdapter(engine_pb2.LoraAdapter(name="tuned", path=adapter))
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await _tokens(stub, _request("x", engine_pb2.LoraAdapter(name="t", path=adapter)))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "ENABLE_LORA" in error.value.details()
        await channel.close()
    finally:
        assert process.stop() == 0, process.output()
