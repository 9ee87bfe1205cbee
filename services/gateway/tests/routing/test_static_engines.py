"""Static engine addresses (no registry yet: `make run`, the e2e stack): the load an
engine's Stats answers reaches the routing policy whole, waiting bounds included, so a
full engine is seen as full, and routed around, as a registered one is."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from conveyor.common.engine_registry import EngineEntry, EngineLoad, EngineRegistry
from conveyor.common.grpc_client import open_channel
from conveyor.common.grpc_server import ServiceRegistration, start_grpc_server
from conveyor.common.settings import ServiceSettings
from conveyor.gateway.clients.engine import EngineClient
from conveyor.gateway.clients.upstream import UpstreamError
from conveyor.gateway.routing.directory import EngineDirectory, EnginePicker, StaticEngines
from conveyor.gateway.routing.policy import LoadPolicy
from conveyor.gateway.routing.router import Router
from conveyor.gateway.routing.settings import RoutingSettings
from conveyor.v1 import engine_pb2, engine_pb2_grpc

FULL = dict(num_running=0, num_waiting=2, kv_usage=0.5, num_free_blocks=5, num_blocks=10,
            num_waiting_tokens=90, max_num_waiting_seqs=2, max_num_waiting_tokens=1000)
"""At its waiting bound: two waiting, room for two (and the fewest requests)."""
BUSY = dict(num_running=5, num_free_blocks=5, num_blocks=10, kv_usage=0.5)
"""More requests, no bound."""


class FakeEngine(engine_pb2_grpc.EngineServicer):
    """An engine of model "m" answering Stats with `stats` (EngineStats' fields)."""

    def __init__(self, engine_id: str, stats: dict, max_loras: int = 0, block_size: int = 16):
        self._info = engine_pb2.EngineInfo(model="m", max_model_len=64, engine_id=engine_id,
                                           max_loras=max_loras, block_size=block_size)
        self._stats = engine_pb2.EngineStats(**stats)

    async def Stats(self, request, context):
        return self._stats

    async def Info(self, request, context):
        return self._info


@contextlib.asynccontextmanager
async def serving(engine: FakeEngine) -> AsyncIterator[EngineClient]:
    """A client of `engine`, served on a free port for the block's duration."""
    server = await start_grpc_server(ServiceSettings(port=0), [ServiceRegistration(
        "conveyor.v1.Engine", engine_pb2_grpc.add_EngineServicer_to_server, engine)])
    channel = open_channel(f"127.0.0.1:{server.port}")
    try:
        yield EngineClient(f"127.0.0.1:{server.port}", channel, rpc_timeout_s=5)
    finally:
        await channel.close()
        await server.server.stop(grace=None)


async def static_entries(*engines: FakeEngine) -> list[EngineEntry]:
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(serving(e)) for e in engines]
        return await StaticEngines(EnginePicker(clients, stats_timeout_s=5)).list_live("m")


async def test_a_static_engine_at_its_waiting_bound_is_full():
    [entry] = await static_entries(FakeEngine("full", FULL))
    assert (entry.load.num_waiting_tokens, entry.load.max_num_waiting_seqs,
            entry.load.max_num_waiting_tokens, entry.load.num_blocks) == (90, 2, 1000, 10)
    assert LoadPolicy().is_full(entry)


async def test_a_static_engine_is_listed_with_the_block_size_and_max_model_len_of_its_info():
    [entry] = await static_entries(FakeEngine("e", BUSY, block_size=32))
    assert (entry.block_size, entry.max_model_len) == (32, 64)


async def test_an_info_without_a_block_size_hints_in_the_default_not_zero():
    """An Info that leaves block_size unset (0 on the wire) must not divide prefix hints
    by zero (a 500 for any prompt)."""
    [entry] = await static_entries(FakeEngine("e", BUSY, block_size=0))
    assert entry.block_size == 16


@pytest.mark.parametrize("path", ["registry", "static"])
async def test_the_router_avoids_a_full_engine_on_either_path(redis, prefix, path):
    registry = EngineRegistry(redis, prefix=prefix)
    async with contextlib.AsyncExitStack() as stack:
        if path == "registry":
            for engine_id, stats in (("full", FULL), ("busy", BUSY)):
                await registry.heartbeat(EngineEntry(engine_id, f"{engine_id}:1", "m",
                                                     EngineLoad(**stats)))
            static = None
        else:
            clients = [await stack.enter_async_context(serving(FakeEngine(i, s)))
                       for i, s in (("full", FULL), ("busy", BUSY))]
            static = StaticEngines(EnginePicker(clients, stats_timeout_s=5))
        router = Router.from_settings(redis, RoutingSettings(), prefix=prefix,
                                      engines=EngineDirectory(registry, static))
        assert (await router.pick(None, [1, 2, 3])).engine_id == "busy"


async def test_a_static_engine_brings_its_max_loras_and_the_adapters_it_holds():
    stats = dict(num_blocks=10, num_free_blocks=10, lora_adapters=["sql", "chat"])
    [entry] = await static_entries(FakeEngine("lora", stats, max_loras=4))
    assert entry.max_loras == 4 and entry.load.lora_adapters == ("sql", "chat")


class StubEngine:
    """An EngineClient's `stats` (None: the engine does not answer), counting calls."""

    def __init__(self, load: EngineLoad | None):
        self.address = "stub:1"
        self.load = load
        self.num_stats_calls = 0

    async def stats(self, timeout_s: float | None = None) -> EngineLoad:
        self.num_stats_calls += 1
        if self.load is None:
            raise UpstreamError("engine", "UNAVAILABLE", "connection refused")
        return self.load


async def test_a_burst_shares_one_stats_round_and_a_silent_engine_has_no_load():
    down, up = StubEngine(None), StubEngine(EngineLoad(**BUSY))
    picker = EnginePicker([down, up], stats_timeout_s=1, max_age_s=60)
    rounds = await asyncio.gather(*(picker.loads() for _ in range(4)))
    assert rounds == [[None, EngineLoad(**BUSY)]] * 4
    assert down.num_stats_calls == up.num_stats_calls == 1
