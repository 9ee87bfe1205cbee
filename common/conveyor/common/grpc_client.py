"""Client channels to other services, with tracing and request-id metadata."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conveyor.common.grpc_interceptors import client_interceptors
from conveyor.common.grpc_server import SERVER_OPTIONS

CHANNEL_OPTIONS = [opt for opt in SERVER_OPTIONS if opt[0] != "grpc.so_reuseport"]


def open_channel(target: str) -> grpc.aio.Channel:
    """An insecure asyncio channel to `target` (host:port) that propagates traces."""
    return grpc.aio.insecure_channel(
        target, options=CHANNEL_OPTIONS, interceptors=client_interceptors()
    )


async def is_serving(channel: grpc.aio.Channel, service: str = "", timeout_s: float = 2.0) -> bool:
    """True when the peer's grpc.health.v1 reports SERVING for `service`."""
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    except grpc.aio.AioRpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING
