"""The asyncio gRPC server every service runs: health, reflection, tracing,
and a graceful drain on SIGTERM, readiness first: health NOT_SERVING at once,
then the service's own `on_signal` (the engine leaves the registry), then
in-flight streams get `drain_timeout_s` to finish, then the process exits."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from conveyor.common.grpc_interceptors import TracingServerInterceptor
from conveyor.common.settings import ServiceSettings

log = logging.getLogger("conveyor.grpc")

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
MIN_CLIENT_PING_INTERVAL_MS = 1000
"""Clients may ping this often without calls in flight (their keepalive_time_s >= 1 s);
the server answers a faster client with GOAWAY too_many_pings."""
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
    # The server pings its callers too, so streams of a caller that vanished end.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.ping_timeout_ms", 5_000),  # what gRPC >= 1.6x waits for a ping's ack
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # Enforcement: accept the clients' keepalive pings (grpc_client.Keepalive).
    ("grpc.http2.min_ping_interval_without_data_ms", MIN_CLIENT_PING_INTERVAL_MS),
    ("grpc.http2.max_ping_strikes", 0),
]


@dataclass(slots=True)
class ServiceRegistration:
    """One gRPC service: its full name (for health and reflection), the
    generated `add_*Servicer_to_server` function and the servicer object."""

    full_name: str
    add_to_server: Callable[[object, grpc.aio.Server], None]
    servicer: object


class GrpcService:
    """A started gRPC server with health and reflection; `port` is the bound port."""

    def __init__(self, server: grpc.aio.Server, health_servicer, names: Sequence[str], port: int):
        self.server = server
        self.health = health_servicer
        self.names = list(names)
        self.port = port

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ["", *self.names]:
            await self.health.set(name, status)

    async def drain(self, timeout_s: float) -> None:
        """Stop taking calls, let in-flight ones finish within timeout_s, then stop.
        Health is already NOT_SERVING when serve_until_signalled calls this."""
        await self.set_serving(False)
        await self.server.stop(grace=timeout_s)


async def start_grpc_server(
    settings: ServiceSettings, registrations: Sequence[ServiceRegistration]
) -> GrpcService:
    """Create, bind and start the server; all services report SERVING."""
    server = grpc.aio.server(interceptors=[TracingServerInterceptor()], options=SERVER_OPTIONS)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for registration in registrations:
        registration.add_to_server(registration.servicer, server)
    names = [r.full_name for r in registrations]
    reflection.enable_server_reflection(
        [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME],
        server,
    )
    port = server.add_insecure_port(f"{settings.host}:{settings.port}")
    if port == 0:
        raise RuntimeError(
            f"cannot listen on {settings.host}:{settings.port}; change the port setting"
        )
    await server.start()
    service = GrpcService(server, health_servicer, names, port)
    await service.set_serving(True)
    return service


async def serve_until_signalled(
    service: GrpcService,
    settings: ServiceSettings,
    on_drained: Callable[[], Awaitable[None]] | None = None,
    on_signal: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Run until SIGTERM or SIGINT; then, in this order: health NOT_SERVING (probes and
    clients see it first), on_signal (e.g. leave a registry so no new calls come), drain
    within drain_timeout_s, on_drained."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # The launcher and tests read this line to learn the bound port.
    print(f"CONVEYOR_LISTENING port={service.port}", flush=True)
    log.info("serving %s on %s:%d", ", ".join(service.names), settings.host, service.port)
    await stop.wait()
    await service.set_serving(False)
    if on_signal is not None:
        await on_signal()
    log.info("draining (up to %.1fs for in-flight calls)", settings.drain_timeout_s)
    await service.drain(settings.drain_timeout_s)
    if on_drained is not None:
        await on_drained()
    log.info("stopped")
