"""Static engine addresses (no registry yet: `make run`, the e2e stack): the load an
engine's Stats answers reaches the routing policy whole, waiting bounds included, so a
full engine is seen as full."""

from __future__ import annotations

import pytest

from conveyor.common.grpc_client import open_channel
from conveyor.common.grpc_server import ServiceRegistration, start_grpc_server
from conveyor.common.settings import ServiceSettings
from conveyor.gateway.routing.router import EngineClient, EnginePicker, LoadPolicy, StaticEngines
from conveyor.v1 import engine_pb2, engine_pb2_grpc


class FullEngine(engine_pb2_grpc.EngineServicer):
    """An engine at its waiting bound: two waiting, room for two."""

    async def Stats(self, request, context):
        return engine_pb2.EngineStats(num_running=4, num_waiting=2, kv_usage=0.5,
                                      num_free_blocks=5, num_blocks=10, num_waiting_tokens=90,
                                      max_num_waiting_seqs=2, max_num_waiting_tokens=1000)

    async def Info(self, request, context):
        return engine_pb2.EngineInfo(model="m", max_model_len=64, engine_id="full")


@pytest.fixture
async def full_engine():
    server = await start_grpc_server(ServiceSettings(port=0), [ServiceRegistration(
        "conveyor.v1.Engine", engine_pb2_grpc.add_EngineServicer_to_server, FullEngine())])
    channel = open_channel(f"127.0.0.1:{server.port}")
    yield EngineClient(f"127.0.0.1:{server.port}", channel, rpc_timeout_s=5)
    await channel.close()
    await server.server.stop(grace=None)


async def test_a_static_engine_at_its_waiting_bound_is_full(full_engine):
    engines = StaticEngines(EnginePicker([full_engine], stats_timeout_s=5))
    [entry] = await engines.list_live("m")
    assert (entry.load.num_waiting_tokens, entry.load.max_num_waiting_seqs,
            entry.load.max_num_waiting_tokens, entry.load.num_blocks) == (90, 2, 1000, 10)
    assert LoadPolicy().is_full(entry)


class LoraEngine(engine_pb2_grpc.EngineServicer):
    """An engine serving up to 4 adapters, holding two."""

    async def Stats(self, request, context):
        return engine_pb2.EngineStats(num_blocks=10, num_free_blocks=10,
                                      lora_adapters=["sql", "chat"])

    async def Info(self, request, context):
        return engine_pb2.EngineInfo(model="m", max_model_len=64, engine_id="lora",
                                     max_loras=4, max_lora_rank=16)


async def test_a_static_engine_brings_its_max_loras_and_the_adapters_it_holds():
    server = await start_grpc_server(ServiceSettings(port=0), [ServiceRegistration(
        "conveyor.v1.Engine", engine_pb2_grpc.add_EngineServicer_to_server, LoraEngine())])
    channel = open_channel(f"127.0.0.1:{server.port}")
    try:
        client = EngineClient(f"127.0.0.1:{server.port}", channel, rpc_timeout_s=5)
        [entry] = await StaticEngines(EnginePicker([client], stats_timeout_s=5)).list_live("m")
    finally:
        await channel.close()
        await server.server.stop(grace=None)
    assert entry.max_loras == 4 and entry.load.lora_adapters == ("sql", "chat")
