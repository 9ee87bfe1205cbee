"""The router against the real Redis: affinity, rebinding, prefix hints, least loaded."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio.connection as redis_connection

from conveyor.common.engine_registry import EngineEntry, EngineLoad, EngineRegistry
from conveyor.common.redis_scripts import run_script_calls
from conveyor.gateway.routing.bindings import PendingBindings
from conveyor.gateway.routing.directory import NoEngineAvailable
from conveyor.gateway.routing.policy import hint_block_size
from conveyor.gateway.routing.router import Router
from conveyor.gateway.routing.settings import RoutingSettings

PROMPT = list(range(100, 148))  # three full 16-token blocks
OTHER_PROMPT = list(range(500, 548))


@pytest.fixture
def settings():
    return RoutingSettings(max_waiting=4, max_kv_usage=0.9, max_imbalance=3)


@pytest.fixture
def registry(redis, prefix):
    return EngineRegistry(redis, prefix=prefix)


@pytest.fixture
def router(redis, prefix, settings):
    return Router.from_settings(redis, settings, prefix=prefix)


@pytest.fixture
def other_router(other_redis, prefix, settings):
    """The router of a second gateway (its own Redis connection)."""
    return Router.from_settings(other_redis, settings, prefix=prefix)


async def engine(registry: EngineRegistry, engine_id: str, running: int = 0, waiting: int = 0,
                 kv: float = 0.0, block_size: int = 16) -> None:
    await registry.heartbeat(EngineEntry(engine_id, f"{engine_id}:50052", "m",
                                         EngineLoad(running, waiting, kv),
                                         block_size=block_size))


async def test_no_engine_is_unavailable(router):
    with pytest.raises(NoEngineAvailable, match="no live engine"):
        await router.pick(None, PROMPT)


async def test_only_engines_of_the_requested_model_are_candidates(registry, router):
    await engine(registry, "a")  # serves "m", idle
    await registry.heartbeat(EngineEntry("b", "b:50052", "other-model", EngineLoad(5)))
    assert (await router.pick(None, [1, 2, 3], model="other-model")).engine_id == "b"
    assert (await router.pick("s1", PROMPT, model="m")).engine_id == "a"
    with pytest.raises(NoEngineAvailable, match="serving 'third-model'"):
        await router.pick(None, PROMPT, model="third-model")


async def test_a_burst_spreads_over_engines_whose_heartbeats_look_the_same(registry, router):
    for engine_id in ("a", "b", "c"):
        await engine(registry, engine_id)  # idle at their last heartbeat
    picked = [(await router.pick(None, [1, 2, 3])).engine_id for _ in range(6)]
    assert sorted(picked) == ["a", "a", "b", "b", "c", "c"]


async def test_least_loaded_without_session_or_hint(registry, router):
    await engine(registry, "a", running=3)
    await engine(registry, "b", running=1, waiting=1)
    await engine(registry, "c", running=2)
    assert (await router.pick(None, [1, 2, 3])).engine_id == "b"


async def test_least_loaded_prefers_engines_that_are_not_overloaded(registry, router):
    await engine(registry, "a", running=0, kv=0.95)
    await engine(registry, "b", running=6)
    assert (await router.pick(None, [1, 2, 3])).engine_id == "b"


async def test_a_session_stays_on_its_engine_while_it_is_healthy(registry, router):
    await engine(registry, "a")
    await engine(registry, "b", running=1)
    assert (await router.pick("s1", PROMPT)).engine_id == "a"
    await engine(registry, "a", running=3, waiting=2)
    assert (await router.pick("s1", PROMPT + [7] * 20)).engine_id == "a"


async def test_two_gateways_route_a_session_to_the_same_engine(registry, router, other_router):
    await engine(registry, "a")
    await engine(registry, "b", running=1)
    assert (await router.pick("s1", PROMPT)).engine_id == "a"
    await engine(registry, "a", running=4)  # b is now the least loaded
    assert (await other_router.pick("s1", PROMPT)).engine_id == "a"


async def test_racing_gateways_agree_on_a_new_session(registry, router, other_router):
    await engine(registry, "a")
    await engine(registry, "b")
    picks = await asyncio.gather(*(r.pick(f"s{i}", [i]) for i in range(10)
                                   for r in (router, other_router)))
    for i in range(10):
        assert picks[2 * i].engine_id == picks[2 * i + 1].engine_id


async def test_session_moves_when_its_engine_is_gone_and_both_gateways_follow(
        registry, router, other_router):
    await engine(registry, "a")
    await engine(registry, "b", running=2)
    await engine(registry, "c", running=3)
    assert (await router.pick("s1", PROMPT)).engine_id == "a"
    await registry.deregister("a")
    assert (await router.pick("s1", PROMPT)).engine_id == "b"
    await engine(registry, "b", running=9)  # b is busy now, but still holds the session
    assert (await other_router.pick("s1", PROMPT)).engine_id == "b"


async def test_session_moves_when_its_engine_misses_heartbeats(redis, prefix, settings):
    short = EngineRegistry(redis, prefix=prefix, ttl_s=0.2)
    router = Router.from_settings(redis, settings, prefix=prefix)
    await engine(short, "a")
    await engine(EngineRegistry(redis, prefix=prefix), "b", running=1)
    assert (await router.pick("s1", PROMPT)).engine_id == "a"
    await asyncio.sleep(0.3)
    assert (await router.pick("s1", PROMPT)).engine_id == "b"


async def test_session_moves_off_an_overloaded_engine_only_if_another_is_not(registry, router):
    await engine(registry, "a")
    await engine(registry, "b", running=1)
    assert (await router.pick("s1", PROMPT)).engine_id == "a"
    await engine(registry, "a", running=8, waiting=5)  # waiting 5 > max_waiting 4
    await engine(registry, "b", running=8, kv=0.95)  # b overloaded too: moving gains nothing
    assert (await router.pick("s1", PROMPT)).engine_id == "a"
    await engine(registry, "b", running=8)
    assert (await router.pick("s1", PROMPT)).engine_id == "b"


async def test_prefix_hint_brings_a_shared_prefix_back_to_its_engine(registry, router):
    await engine(registry, "a")
    await engine(registry, "b", running=1)
    assert (await router.pick(None, PROMPT)).engine_id == "a"
    await engine(registry, "a", running=3)  # b less loaded, but within max_imbalance (3)
    assert (await router.pick(None, PROMPT[:32] + [9] * 20)).engine_id == "a"
    assert (await router.pick(None, OTHER_PROMPT)).engine_id == "b"


async def test_prefix_hint_yields_when_its_engine_is_much_busier(registry, router):
    await engine(registry, "a")
    await engine(registry, "b", running=1)
    assert (await router.pick(None, PROMPT)).engine_id == "a"
    await engine(registry, "a", running=5)  # 4 more than b: beyond max_imbalance
    assert (await router.pick(None, PROMPT)).engine_id == "b"


async def test_prefix_hints_do_not_cross_cache_salts(registry, router):
    await engine(registry, "a")
    await engine(registry, "b", running=1)
    assert (await router.pick(None, PROMPT, cache_salt="tenant:acme")).engine_id == "a"
    await engine(registry, "a", running=2)
    assert (await router.pick(None, PROMPT, cache_salt="tenant:globex")).engine_id == "b"
    assert (await router.pick(None, PROMPT, cache_salt="tenant:acme")).engine_id == "a"


async def test_hints_are_hashed_in_the_block_size_the_engines_publish(redis, registry, router):
    """Engines of block size 32: a 48-token prompt is one full block, and a prompt sharing
    only its first 31 tokens shares no block (in 16-token blocks it would share one)."""
    await engine(registry, "a", block_size=32)
    await engine(registry, "b", running=1, block_size=32)
    pending = PendingBindings()
    assert (await router.pick(None, PROMPT, pending=pending)).engine_id == "a"
    assert len(pending.calls) == 1
    await run_script_calls(redis, pending.calls)
    await engine(registry, "a", running=3, block_size=32)  # b less loaded, within imbalance
    assert (await router.pick(None, PROMPT[:32] + [9] * 20)).engine_id == "a"
    assert (await router.pick(None, PROMPT[:31] + [9] * 21)).engine_id == "b"


def test_engines_that_disagree_are_hinted_in_the_size_most_of_them_publish():
    def sized(*sizes: int) -> list[EngineEntry]:
        return [EngineEntry(str(i), f"{i}:1", "m", block_size=s) for i, s in enumerate(sizes)]

    assert hint_block_size(sized(32, 16, 32)) == 32
    assert hint_block_size(sized(32, 16)) == 16  # a tie: the smaller
    assert hint_block_size(sized(64)) == 64


async def test_a_hint_to_a_gone_engine_is_replaced(registry, router):
    await engine(registry, "a")
    await engine(registry, "b", running=1)
    await engine(registry, "c", running=2)
    assert (await router.pick(None, PROMPT)).engine_id == "a"
    await registry.deregister("a")
    assert (await router.pick(None, PROMPT)).engine_id == "b"
    await engine(registry, "b", running=3)  # c least loaded now; the hint says b
    assert (await router.pick(None, PROMPT)).engine_id == "b"


async def test_a_pick_leaves_its_bindings_pending_for_the_request_to_write(
        redis, registry, router, other_router):
    await engine(registry, "a")
    await engine(registry, "b", running=1)
    pending = PendingBindings()
    assert (await router.pick("s1", PROMPT, pending=pending)).engine_id == "a"
    assert len(pending.calls) == 1 + 3  # the session, three prefix hints
    await engine(registry, "a", running=4)  # b is now the least loaded
    unwritten = await other_router.pick("s1", PROMPT[:32] + [9], pending=PendingBindings())
    assert unwritten.engine_id == "b"  # nothing written yet: no session, no hint
    await run_script_calls(redis, pending.calls)
    assert (await other_router.pick("s1", PROMPT)).engine_id == "a"  # written: both follow
    assert (await other_router.pick(None, PROMPT[:32] + [9])).engine_id == "a"


async def test_a_later_pick_of_the_request_replaces_its_pending_bindings(
        redis, registry, router):
    await engine(registry, "a")
    await engine(registry, "b", running=1)
    pending = PendingBindings()
    assert (await router.pick("s1", [1], pending=pending)).engine_id == "a"
    moved = await router.pick("s1", [1], exclude=["a"], pending=pending)  # a failed
    assert moved.engine_id == "b"
    await run_script_calls(redis, pending.calls)
    assert (await router.pick("s1", [1])).engine_id == "b"


async def test_a_bound_session_and_its_hints_are_read_in_one_round_trip(
        redis, registry, router, monkeypatch):
    await engine(registry, "a")
    assert (await router.pick("s1", PROMPT)).engine_id == "a"
    sent, send = [], redis_connection.AbstractConnection.send_packed_command

    async def counted(conn, command, check_health=True):
        sent.append(command)
        return await send(conn, command, check_health)

    monkeypatch.setattr(redis_connection.AbstractConnection, "send_packed_command", counted)
    pending = PendingBindings()
    assert (await router.pick("s1", PROMPT, pending=pending)).engine_id == "a"
    assert len(sent) == 2 and pending.calls == []  # the registry's list, then the bindings


def test_routing_settings_read_the_gateway_prefix(monkeypatch):
    monkeypatch.setenv("CONVEYOR_GATEWAY_MAX_WAITING", "2")
    monkeypatch.setenv("CONVEYOR_GATEWAY_SESSION_TTL_S", "60")
    settings = RoutingSettings()
    assert (settings.max_waiting, settings.session_ttl_s) == (2, 60.0)
