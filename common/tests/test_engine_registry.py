"""The engine registry against the real Redis at CONVEYOR_REDIS_URL (default 127.0.0.1:6379)."""

from __future__ import annotations

import asyncio
import os

import pytest
from redis.asyncio import Redis

from conveyor.common.engine_registry import (
    EngineEntry,
    EngineHeartbeat,
    EngineLoad,
    EngineRegistry,
)


def entry(engine_id: str, running: int = 0, waiting: int = 0, kv: float = 0.0) -> EngineEntry:
    return EngineEntry(engine_id, f"{engine_id}:50052", "m", EngineLoad(running, waiting, kv))


async def test_registered_engines_are_listed_with_their_load(redis, prefix):
    registry = EngineRegistry(redis, prefix=prefix)
    await registry.heartbeat(entry("b", running=2, waiting=1, kv=0.5))
    await registry.heartbeat(entry("a"))
    assert await registry.list_live() == [entry("a"), entry("b", 2, 1, 0.5)]


async def test_heartbeat_replaces_the_load(redis, prefix):
    registry = EngineRegistry(redis, prefix=prefix)
    await registry.heartbeat(entry("a", running=1))
    await registry.heartbeat(entry("a", running=7, kv=0.25))
    assert await registry.list_live() == [entry("a", 7, 0, 0.25)]


async def test_entries_expire_after_the_ttl(redis, prefix):
    registry = EngineRegistry(redis, prefix=prefix, ttl_s=0.2)
    await registry.heartbeat(entry("a"))
    assert [e.engine_id for e in await registry.list_live()] == ["a"]
    await asyncio.sleep(0.3)
    assert await registry.list_live() == []
    assert await redis.hlen(f"{prefix}:engines:entries") == 0


async def test_a_second_client_sees_the_same_engines(redis, other_redis, prefix):
    await EngineRegistry(redis, prefix=prefix).heartbeat(entry("a"))
    assert await EngineRegistry(other_redis, prefix=prefix).list_live() == [entry("a")]


async def test_deregister_removes_at_once(redis, prefix):
    registry = EngineRegistry(redis, prefix=prefix)
    await registry.heartbeat(entry("a"))
    assert await registry.deregister("a") is True
    assert await registry.deregister("a") is False
    assert await registry.list_live() == []


async def test_list_filters_by_model(redis, prefix):
    registry = EngineRegistry(redis, prefix=prefix)
    await registry.heartbeat(entry("a"))
    await registry.heartbeat(EngineEntry("b", "b:1", "other"))
    assert [e.engine_id for e in await registry.list_live(model="other")] == ["b"]


async def test_heartbeat_loop_keeps_the_engine_alive_past_the_ttl_and_stop_removes_it(
        redis, prefix):
    registry = EngineRegistry(redis, prefix=prefix, ttl_s=0.3)
    load = {"running": 0}
    heartbeat = EngineHeartbeat(registry, EngineEntry("a", "a:1", "m"),
                                read_load=lambda: EngineLoad(num_running=load["running"]),
                                interval_s=0.05)
    await heartbeat.start()
    load["running"] = 3
    await asyncio.sleep(0.5)
    assert await registry.list_live() == [EngineEntry("a", "a:1", "m", EngineLoad(3))]
    await heartbeat.stop()
    assert await registry.list_live() == []


async def test_heartbeat_publishes_the_engines_block_size_and_max_model_len(redis, prefix):
    """What gateways must agree with rides on the entry; an entry of an engine that predates
    them reads as the default block size and no published max_model_len."""
    registry = EngineRegistry(redis, prefix=prefix)
    published = EngineEntry("a", "a:1", "m", block_size=32, max_model_len=512)
    await EngineHeartbeat(registry, published, read_load=lambda: EngineLoad(2)).beat()
    [listed] = await registry.list_live()
    assert (listed.block_size, listed.max_model_len, listed.load) == (32, 512, EngineLoad(2))
    older = '{"engine_id":"b","address":"b:1","model":"m","load":{}}'
    assert (EngineEntry.from_json(older).block_size,
            EngineEntry.from_json(older).max_model_len) == (16, None)


async def test_interval_must_be_shorter_than_ttl(redis, prefix):
    registry = EngineRegistry(redis, prefix=prefix, ttl_s=1.0)
    with pytest.raises(ValueError, match="interval_s"):
        EngineHeartbeat(registry, EngineEntry("a", "a:1", "m"), read_load=EngineLoad,
                        interval_s=1.0)


async def test_client_without_decoded_responses_is_refused():
    client = Redis.from_url(os.environ.get("CONVEYOR_REDIS_URL", "redis://127.0.0.1:6379/0"))
    with pytest.raises(ValueError, match="decode_responses=True"):
        EngineRegistry(client)
    await client.aclose()
