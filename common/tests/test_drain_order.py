"""SIGTERM on a gRPC service, readiness first: health is NOT_SERVING before the
service's own on_signal step (the engine leaves its registry there), then the drain."""

from __future__ import annotations

import asyncio
import os
import signal

from conveyor.common.grpc_client import is_serving, open_channel
from conveyor.common.grpc_server import (
    ServiceRegistration,
    serve_until_signalled,
    start_grpc_server,
)
from conveyor.common.settings import ServiceSettings
from conveyor.v1 import tokenizer_pb2, tokenizer_pb2_grpc

TOKENIZER = tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"].full_name


async def test_health_is_not_serving_before_on_signal_runs():
    settings = ServiceSettings(port=0, drain_timeout_s=1.0)
    registration = ServiceRegistration(
        TOKENIZER, tokenizer_pb2_grpc.add_TokenizerServicer_to_server,
        tokenizer_pb2_grpc.TokenizerServicer())
    service = await start_grpc_server(settings, [registration])
    channel = open_channel(f"127.0.0.1:{service.port}")
    steps: list[tuple[str, bool]] = []

    async def on_signal() -> None:
        steps.append(("on_signal", await is_serving(channel, TOKENIZER)))

    async def on_drained() -> None:
        steps.append(("drained", False))

    loop = asyncio.get_running_loop()
    serving = asyncio.create_task(serve_until_signalled(service, settings, on_drained,
                                                        on_signal))
    try:
        assert await is_serving(channel, TOKENIZER)
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(serving, timeout=10)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await channel.close()
    assert steps == [("on_signal", False), ("drained", False)]
