"""LoRA in the Engine service, with the fake runner underneath: reading an adapter happens
off the step loop (other requests run meanwhile), the scheduler keeps a step's adapters
within max_loras (a further adapter's request waits for a slot), and a request naming an
adapter on an engine with LoRA off is INVALID_ARGUMENT."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from conveyor.engine.engine_request import EngineRequest
from conveyor.engine.lora import adapter_store
from conveyor.engine.lora.adapter import LoraAdapter
from conveyor.engine.lora.adapter_store import AdapterStore
from conveyor.engine.sampling_params import SamplingParams
from conveyor.v1 import engine_pb2


def _adapter(name: str) -> LoraAdapter:
    return LoraAdapter(name, key=f"key-{name}", rank=8, target_modules=("q_proj",), weights={})


def _request(request_id: str, lora: str | None = None, max_tokens: int = 4):
    sampling = engine_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    adapter = engine_pb2.LoraAdapter(name=lora, path=f"/adapters/{lora}") if lora else None
    return engine_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=[5, 6, 7],
                                      sampling=sampling, lora=adapter)


async def _tokens(stub, request) -> list[int]:
    return [t async for chunk in stub.Generate(request) for t in chunk.token_ids]


async def test_reading_an_adapter_does_not_hold_up_other_requests(support, monkeypatch):
    reading, release = threading.Event(), threading.Event()

    def slow_read(name, path, *args):
        reading.set()
        assert release.wait(30)
        return _adapter(name)

    monkeypatch.setattr(adapter_store, "read_adapter", slow_read)
    core = support.make_core(max_loras=2)
    core.loras = AdapterStore(None, max_rank=8, capacity=4)
    async with support.serve_engine(core) as (engine, stub):
        tuned = asyncio.create_task(_tokens(stub, _request("tuned", "tuned")))
        assert await asyncio.to_thread(reading.wait, 30)
        assert len(await _tokens(stub, _request("base", max_tokens=8))) == 8  # meanwhile
        assert not tuned.done()
        release.set()
        assert len(await tuned) == 4
        assert engine.stats().lora_adapters == ("tuned",)


def test_a_step_holds_at_most_max_loras_adapters(support):
    core = support.make_core(max_loras=1)
    for name in ("a", "b"):
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        core.add_request(EngineRequest(name, [5, 6, 7], params, lora=_adapter(name)))
    order = []
    while core.has_unfinished_requests:
        deltas = core.step()
        assert len({r.lora.key for r in core.scheduler.running}) <= 1
        order += [(d.request_id, d.finished) for d in deltas if d.new_token_ids]
    first_b = next(i for i, (rid, _) in enumerate(order) if rid == "b")
    assert ("a", True) in order[:first_b]  # b ran only once a had finished


async def test_an_engine_with_lora_off_refuses_adapters(support):
    async with support.serve_engine(support.make_core()) as (engine, stub):
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await _tokens(stub, _request("x", "tuned"))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "ENABLE_LORA" in error.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.LoadLoraAdapter(engine_pb2.LoraAdapter(name="tuned", path="/x"))
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert engine.stats().num_waiting == engine.stats().num_running == 0
