"""Engine bindings against the real Redis: two gateways agree, TTLs refresh on use."""

from __future__ import annotations

import asyncio

import pytest

from conveyor.gateway.routing.router import EngineBindings, prefix_block_hashes


@pytest.fixture
def two_gateways(redis, other_redis, prefix):
    return (EngineBindings(redis, "session", prefix=prefix, ttl_s=60),
            EngineBindings(other_redis, "session", prefix=prefix, ttl_s=60))


async def test_first_binding_wins_for_both_gateways(two_gateways):
    first, second = two_gateways
    winners = await asyncio.gather(first.bind("s1", "engine-a"), second.bind("s1", "engine-b"))
    assert winners[0] == winners[1]
    assert await first.get("s1") == await second.get("s1") == winners[0]


async def test_a_rebind_only_replaces_what_the_gateway_saw(two_gateways):
    first, second = two_gateways
    await first.bind("s1", "engine-a")
    assert await first.bind("s1", "engine-b", replacing="engine-a") == "engine-b"
    # the second gateway also saw engine-a gone, but the first already moved the session
    assert await second.bind("s1", "engine-c", replacing="engine-a") == "engine-b"


async def test_bindings_expire_unless_used(redis, prefix):
    bindings = EngineBindings(redis, "session", prefix=prefix, ttl_s=0.3)
    await bindings.bind("used", "engine-a")
    await bindings.bind("idle", "engine-a")
    await asyncio.sleep(0.2)
    assert await bindings.get("used") == "engine-a"
    await asyncio.sleep(0.2)
    assert await bindings.get("used") == "engine-a"
    assert await bindings.get("idle") is None
    assert await bindings.bind("idle", "engine-b", replacing="engine-a") == "engine-b"


async def test_bind_many_and_get_many(redis, prefix):
    bindings = EngineBindings(redis, "prefix", prefix=prefix, ttl_s=60)
    assert await bindings.bind_many([("h1", "a", None), ("h2", "a", None)]) == ["a", "a"]
    assert await bindings.get_many(["h1", "h2", "h3"]) == ["a", "a", None]
    await bindings.unbind("h1")
    assert await bindings.get_many(["h1"]) == [None]


def test_prefix_hashes_cover_full_blocks_only_and_chain():
    prompt = list(range(40))
    hashes = prefix_block_hashes(prompt, block_size=16, max_blocks=4)
    assert len(hashes) == 2  # 40 tokens: two full blocks
    assert prefix_block_hashes(prompt[:16] + [99] * 16, 16, 4)[0] == hashes[0]
    assert prefix_block_hashes(prompt[:16] + [99] * 16, 16, 4)[1] != hashes[1]
    assert prefix_block_hashes([99] + prompt[1:], 16, 4)[1] != hashes[1]
    assert prefix_block_hashes(prompt, 16, 1) == hashes[:1]
    assert prefix_block_hashes(prompt[:15], 16, 4) == []


def test_prefix_hashes_differ_per_cache_salt():
    prompt = list(range(32))
    acme = prefix_block_hashes(prompt, 16, 4, cache_salt="tenant:acme")
    globex = prefix_block_hashes(prompt, 16, 4, cache_salt="tenant:globex")
    assert set(acme).isdisjoint(globex)
