"""Client channels to other services, with tracing, request-id metadata and keepalive."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conveyor.common.grpc_interceptors import client_interceptors
from conveyor.common.grpc_server import MAX_MESSAGE_BYTES, MIN_CLIENT_PING_INTERVAL_MS


@dataclass(slots=True, frozen=True)
class Keepalive:
    """HTTP/2 keepalive of a channel: a ping every `time_s`, with or without calls in
    flight; a peer that does not answer within `timeout_s` (a SIGSTOP'ed process, a cut
    link: nothing resets the connection) is dropped, failing its calls with UNAVAILABLE.
    A dead peer is thus found within about time_s + timeout_s."""

    time_s: float = 2.0
    timeout_s: float = 2.0

    def __post_init__(self) -> None:
        if self.time_s * 1000 < MIN_CLIENT_PING_INTERVAL_MS:
            raise ValueError(f"keepalive time_s must be >= {MIN_CLIENT_PING_INTERVAL_MS / 1000}"
                             f" s (servers refuse faster pings), got {self.time_s}")
        if self.timeout_s <= 0:
            raise ValueError(f"keepalive timeout_s must be > 0, got {self.timeout_s}")

    def channel_options(self) -> list[tuple[str, int]]:
        return [
            ("grpc.keepalive_time_ms", round(self.time_s * 1000)),
            ("grpc.keepalive_timeout_ms", round(self.timeout_s * 1000)),
            # gRPC >= 1.6x times a keepalive ping's ack out with this one.
            ("grpc.http2.ping_timeout_ms", round(self.timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
        ]


DEFAULT_KEEPALIVE = Keepalive()


def channel_options(keepalive: Keepalive = DEFAULT_KEEPALIVE) -> list[tuple[str, int]]:
    """Every channel's options: message size limits and keepalive."""
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        *keepalive.channel_options(),
    ]


def open_channel(target: str, keepalive: Keepalive = DEFAULT_KEEPALIVE) -> grpc.aio.Channel:
    """An insecure asyncio channel to `target` (host:port) that propagates traces."""
    return grpc.aio.insecure_channel(
        target, options=channel_options(keepalive), interceptors=client_interceptors()
    )


class Channels:
    """A lazy {address: channel} cache, one keepalive for all; `close()` closes every
    channel opened.

    A channel taken with `channel` stays open until `close()` (a caller keeps it). Calls
    made through `lease` are counted per address: past `max_idle` leased channels without a
    call, the least recently leased ones are closed, so the channels to replicas that went
    away (a restarted engine comes back at another address) do not pile up."""

    def __init__(self, keepalive: Keepalive = DEFAULT_KEEPALIVE, max_idle: int = 8):
        self._keepalive = keepalive
        self._max_idle = max_idle
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._calls: dict[str, int] = {}
        self._kept: set[str] = set()

    def channel(self, address: str) -> grpc.aio.Channel:
        """The channel to `address` (host:port), kept open until `close()`; never awaits."""
        self._kept.add(address)
        return self._open(address)

    def _open(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = open_channel(address, self._keepalive)
        return channel

    @contextlib.asynccontextmanager
    async def lease(self, address: str) -> AsyncIterator[grpc.aio.Channel]:
        """The channel to `address` for one call: counted while the block runs (no await
        on the way out, so a cancelled call releases it too)."""
        idle = [a for a in self._channels
                if a != address and a not in self._kept and not self._calls.get(a)]
        stale = [self._channels.pop(a) for a in idle[:max(0, len(idle) - self._max_idle)]]
        for channel in stale:  # taken out at once: a concurrent lease never sees them
            await channel.close()
        channel = self._open(address)
        self._channels[address] = self._channels.pop(address)  # the most recent last
        self._calls[address] = self._calls.get(address, 0) + 1
        try:
            yield channel
        finally:
            self._calls[address] -= 1
            if not self._calls[address]:
                del self._calls[address]

    @property
    def addresses(self) -> list[str]:
        """The addresses with an open channel."""
        return list(self._channels)

    async def close_one(self, address: str) -> None:
        """Close the channel to `address` (calls still on it end)."""
        self._kept.discard(address)
        await self._channels.pop(address).close()

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()


async def is_serving(channel: grpc.aio.Channel, service: str = "", timeout_s: float = 2.0) -> bool:
    """True when the peer's grpc.health.v1 reports SERVING for `service`."""
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    except grpc.aio.AioRpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING
