"""The engine directory against the real Redis: one registry read per interval, shared
by all requests of a gateway, and the last listing kept while Redis is unavailable."""

from __future__ import annotations

import asyncio

from redis.exceptions import ConnectionError as RedisConnectionError

from conveyor.common.engine_registry import EngineEntry, EngineLoad, EngineRegistry
from conveyor.gateway.routing.directory import EngineDirectory


class CountedRegistry(EngineRegistry):
    """The real registry, counting its reads; `failing` makes them raise."""

    num_reads = 0
    failing = False

    async def list_live(self, model=None):
        self.num_reads += 1
        if self.failing:
            raise RedisConnectionError("Redis went away")
        return await super().list_live(model)


async def _engine(registry: EngineRegistry, engine_id: str, model: str = "m") -> None:
    await registry.heartbeat(EngineEntry(engine_id, f"{engine_id}:50052", model, EngineLoad()))


def _ids(entries: list[EngineEntry]) -> list[str]:
    return [e.engine_id for e in entries]


async def test_concurrent_requests_share_one_registry_read_per_interval(redis, prefix):
    registry = CountedRegistry(redis, prefix=prefix)
    await _engine(registry, "a")
    await _engine(registry, "b", model="other")
    directory = EngineDirectory(registry, None, max_age_s=60)
    listings = await asyncio.gather(*(directory.list_live("m") for _ in range(20)))
    assert all(_ids(listed) == ["a"] for listed in listings)
    assert _ids(await directory.list_live("other")) == ["b"]  # one listing, every model
    assert registry.num_reads == 1


async def test_an_engine_that_registers_is_listed_within_max_age(redis, prefix):
    registry = CountedRegistry(redis, prefix=prefix)
    await _engine(registry, "a")
    directory = EngineDirectory(registry, None, max_age_s=0.2)
    assert _ids(await directory.list_live()) == ["a"]
    await _engine(registry, "b")
    registered_at = asyncio.get_running_loop().time()
    assert _ids(await directory.list_live()) == ["a"]  # the listing of this interval
    while _ids(await directory.list_live()) != ["a", "b"]:
        assert asyncio.get_running_loop().time() - registered_at < 0.2 + 0.3, "b not listed"
        await asyncio.sleep(0.02)
    assert registry.num_reads == 2


async def test_while_redis_is_unavailable_the_last_listing_stands(
        redis, prefix):
    registry = CountedRegistry(redis, prefix=prefix)
    await _engine(registry, "a")
    directory = EngineDirectory(registry, None, max_age_s=0)
    assert _ids(await directory.list_live()) == ["a"]
    registry.failing = True
    assert _ids(await directory.list_live()) == ["a"]
    directory.mark_unreachable("a")
    assert await directory.list_live() == []
