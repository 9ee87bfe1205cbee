"""One gRPC client per engine address, opened the first time a request goes there.

Engines come and go (they register in Redis), so the gateway cannot open their
channels at startup; it opens one per address on first use and keeps it, as
gRPC channels reconnect by themselves.
"""

from __future__ import annotations

import grpc

from conveyor.common.grpc_client import open_channel
from conveyor.gateway.engine_client import EngineClient


class EngineClients:
    """A lazy {address: EngineClient} cache; `close()` closes every channel opened."""

    def __init__(self, rpc_timeout_s: float):
        self._rpc_timeout_s = rpc_timeout_s
        self._clients: dict[str, EngineClient] = {}
        self._channels: list[grpc.aio.Channel] = []

    def client(self, address: str) -> EngineClient:
        """The client of the engine at `address` (host:port); never awaits."""
        client = self._clients.get(address)
        if client is None:
            channel = open_channel(address)
            self._channels.append(channel)
            client = self._clients[address] = EngineClient(address, channel,
                                                           self._rpc_timeout_s)
        return client

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()
