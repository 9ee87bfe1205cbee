"""Start the engine: load the model, run the engine loop, serve Engine over gRPC until SIGTERM."""

from __future__ import annotations

import asyncio
import functools
import logging

from conveyor.common.grpc_server import (
    ServiceRegistration,
    serve_until_signalled,
    start_grpc_server,
)
from conveyor.common.log import setup_logging
from conveyor.common.tracing import setup_tracing
from conveyor.engine.async_engine import AsyncEngine
from conveyor.engine.engine_factory import build_engine_core
from conveyor.engine.engine_info import EngineInfo
from conveyor.engine.metrics import EngineMetrics
from conveyor.engine.registration import Registration, build_registration
from conveyor.engine.servicer import SERVICE_NAME, EngineServicer
from conveyor.engine.settings import EngineSettings
from conveyor.v1 import engine_pb2_grpc

log = logging.getLogger("conveyor.engine")


def registration(engine: AsyncEngine) -> ServiceRegistration:
    """The Engine service over a started AsyncEngine, ready for start_grpc_server."""
    return ServiceRegistration(SERVICE_NAME, engine_pb2_grpc.add_EngineServicer_to_server,
                               EngineServicer(engine))


def start_metrics(settings: EngineSettings, info: EngineInfo) -> EngineMetrics:
    metrics = EngineMetrics.for_engine(info)
    if settings.metrics_port:
        metrics.serve(settings.metrics_port, settings.host)
        log.info("Prometheus metrics on http://%s:%d/metrics", settings.host,
                 settings.metrics_port)
    return metrics


async def serve(settings: EngineSettings) -> None:
    """Serve and register in the engine registry until SIGTERM or SIGINT; then leave the
    registry (no new requests are routed here), drain in-flight streams, stop the loop."""
    setup_logging("engine", settings.log_level, settings.log_json)
    setup_tracing("conveyor-engine")
    # The loop thread builds the core, so all of the model's torch work runs on that one
    # thread (async_engine.py says why); this thread only waits for it.
    engine = await asyncio.to_thread(
        AsyncEngine(functools.partial(build_engine_core, settings)).start)
    engine.metrics = start_metrics(settings, engine.info)

    async def stop_engine() -> None:
        await asyncio.to_thread(engine.shutdown)

    entry: Registration | None = None
    try:
        service = await start_grpc_server(settings, [registration(engine)])
        entry = build_registration(settings, engine, service.port)
        if entry is not None:
            await entry.start()
        await serve_until_signalled(service, settings, on_drained=stop_engine,
                                    on_signal=entry.stop if entry is not None else None)
    finally:
        engine.shutdown()
