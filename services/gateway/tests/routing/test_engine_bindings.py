"""Engine bindings against the real Redis: two gateways agree, TTLs refresh on use."""

from __future__ import annotations

import asyncio

import pytest

from conveyor.common.redis_scripts import run_script_calls
from conveyor.gateway.routing.bindings import EngineBindings
from conveyor.gateway.routing.policy import prefix_block_hashes


async def bind(bindings: EngineBindings, name: str, engine_id: str,
               replacing: str | None = None) -> str:
    [bound] = await run_script_calls(bindings.redis,
                                     [bindings.bind_call(name, engine_id, replacing=replacing)])
    return bound


async def get(bindings: EngineBindings, name: str) -> str | None:
    async with bindings.pipeline() as pipe:
        bindings.queue_get(pipe, name)
        [bound] = await pipe.execute()
    return bound


@pytest.fixture
def two_gateways(redis, other_redis, prefix):
    return (EngineBindings(redis, "session", prefix=prefix, ttl_s=60),
            EngineBindings(other_redis, "session", prefix=prefix, ttl_s=60))


async def test_first_binding_wins_for_both_gateways(two_gateways):
    first, second = two_gateways
    winners = await asyncio.gather(bind(first, "s1", "engine-a"), bind(second, "s1", "engine-b"))
    assert winners[0] == winners[1]
    assert await get(first, "s1") == await get(second, "s1") == winners[0]


async def test_a_rebind_only_replaces_what_the_gateway_saw(two_gateways):
    first, second = two_gateways
    await bind(first, "s1", "engine-a")
    assert await bind(first, "s1", "engine-b", replacing="engine-a") == "engine-b"
    # the second gateway also saw engine-a gone, but the first already moved the session
    assert await bind(second, "s1", "engine-c", replacing="engine-a") == "engine-b"


async def test_bindings_expire_unless_used(redis, prefix):
    bindings = EngineBindings(redis, "session", prefix=prefix, ttl_s=0.3)
    await bind(bindings, "used", "engine-a")
    await bind(bindings, "idle", "engine-a")
    await asyncio.sleep(0.2)
    assert await get(bindings, "used") == "engine-a"
    await asyncio.sleep(0.2)
    assert await get(bindings, "used") == "engine-a"
    assert await get(bindings, "idle") is None
    assert await bind(bindings, "idle", "engine-b", replacing="engine-a") == "engine-b"


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
