"""Client of one engine replica: Generate streams, Stats and Info."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from conveyor.gateway import convert
from conveyor.gateway.engine_records import EngineChunk, EngineFacts, EngineLoad, GenerateJob
from conveyor.gateway.upstream_error import translate_rpc_errors
from conveyor.v1 import engine_pb2_grpc

SERVICE = "engine"


class EngineStream:
    """An open Generate stream. Iterate it for chunks; `cancel()` aborts the
    request in the engine (its KV blocks go back to the pool at the next step)."""

    def __init__(self, call: grpc.aio.UnaryStreamCall):
        self._call = call

    async def __aiter__(self) -> AsyncIterator[EngineChunk]:
        with translate_rpc_errors(SERVICE):
            async for message in self._call:
                yield convert.engine_chunk(message)

    def cancel(self) -> None:
        self._call.cancel()


class EngineClient:
    """Calls to the engine at `address` over one shared channel."""

    def __init__(self, address: str, channel: grpc.aio.Channel, rpc_timeout_s: float):
        self.address = address
        self._stub = engine_pb2_grpc.EngineStub(channel)
        self._timeout_s = rpc_timeout_s

    def generate(self, job: GenerateJob) -> EngineStream:
        """Start generating; nothing is awaited until the stream is iterated."""
        return EngineStream(self._stub.Generate(convert.generate_request(job)))

    async def stats(self, timeout_s: float | None = None) -> EngineLoad:
        with translate_rpc_errors(SERVICE):
            reply = await self._stub.Stats(
                convert.stats_request(), timeout=timeout_s or self._timeout_s
            )
        return convert.engine_load(reply)

    async def info(self) -> EngineFacts:
        with translate_rpc_errors(SERVICE):
            reply = await self._stub.Info(convert.engine_info_request(), timeout=self._timeout_s)
        return convert.engine_facts(reply)
