"""Keepalive on real channels and servers: a peer that stops answering without resetting
the connection (SIGSTOP) fails calls with UNAVAILABLE within about keepalive time +
timeout, and the servers accept the clients' pings on an idle connection."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conveyor.common.grpc_client import Keepalive, open_channel

KEEPALIVE = Keepalive(time_s=1.0, timeout_s=1.0)

SERVER = """
import asyncio
from conveyor.common.grpc_server import start_grpc_server
from conveyor.common.settings import ServiceSettings

async def main():
    service = await start_grpc_server(ServiceSettings(port=0), [])
    print(service.port, flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


@pytest.fixture
def server_process():
    process = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    port = int(process.stdout.readline())
    yield process, f"127.0.0.1:{port}"
    os.kill(process.pid, signal.SIGCONT)
    process.kill()
    process.wait()


async def check(channel, timeout_s: float = 30.0):
    return await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(), timeout=timeout_s)


async def test_a_stopped_peer_fails_calls_within_the_keepalive_bound(server_process):
    process, address = server_process
    channel = open_channel(address, KEEPALIVE)
    try:
        await check(channel)
        os.kill(process.pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await check(channel)
        elapsed = time.monotonic() - started
    finally:
        await channel.close()
    assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
    assert elapsed < KEEPALIVE.time_s + KEEPALIVE.timeout_s + 3.0


async def test_servers_accept_the_clients_pings_on_an_idle_connection(server_process):
    _, address = server_process
    channel = open_channel(address, KEEPALIVE)
    try:
        await check(channel)
        await asyncio.sleep(4 * KEEPALIVE.time_s)  # several pings with no call in flight
        assert channel.get_state() is grpc.ChannelConnectivity.READY
        await check(channel, timeout_s=2.0)
    finally:
        await channel.close()


def test_pings_faster_than_servers_accept_are_refused():
    with pytest.raises(ValueError, match="keepalive time_s"):
        Keepalive(time_s=0.5)
