"""Channels.lease: channels without calls beyond `max_idle` are closed, the least recently
leased first; a channel with a call in flight never is. (Channels connect lazily: no
server is needed to open and close them.)"""

from __future__ import annotations

import asyncio

import pytest

from conveyor.common.grpc_client import Channels


def _address(i: int) -> str:
    return f"127.0.0.1:{40000 + i}"


async def _call_on(channels: Channels, address: str) -> None:
    async with channels.lease(address):
        pass


async def test_channels_past_max_idle_are_closed_least_recent_first():
    channels = Channels(max_idle=2)
    for i in range(6):
        await _call_on(channels, _address(i))
    assert channels.addresses == [_address(3), _address(4), _address(5)]
    await _call_on(channels, _address(3))  # leased again: now the most recent
    await _call_on(channels, _address(6))
    assert channels.addresses == [_address(5), _address(3), _address(6)]
    await channels.close()


async def test_a_channel_with_a_call_in_flight_stays_open():
    channels = Channels(max_idle=0)
    held = asyncio.Event()
    release = asyncio.Event()

    async def long_call() -> None:
        async with channels.lease(_address(0)):
            held.set()
            await release.wait()

    task = asyncio.create_task(long_call())
    await held.wait()
    for i in range(1, 4):
        await _call_on(channels, _address(i))
    assert _address(0) in channels.addresses
    task.cancel()  # a cancelled call releases its lease on the way out
    with pytest.raises(asyncio.CancelledError):
        await task
    await _call_on(channels, _address(9))
    assert channels.addresses == [_address(9)]
    await channels.close()


async def test_a_kept_channel_is_never_closed_by_leases():
    channels = Channels(max_idle=0)
    kept = channels.channel(_address(0))  # a configured engine's: its client holds it
    for i in range(1, 4):
        await _call_on(channels, _address(i))
    assert channels.addresses == [_address(0), _address(3)]
    await _call_on(channels, _address(0))  # leased as well: still kept afterwards
    await _call_on(channels, _address(4))
    assert _address(0) in channels.addresses and channels.channel(_address(0)) is kept
    await channels.close()
