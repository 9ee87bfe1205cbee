"""Routing requests that name a LoRA adapter (real Redis): engines holding the adapter
are preferred while they are not overloaded or much busier, engines with LoRA off never
get one, a session stays where it is bound, and prefix hints are per adapter."""

from __future__ import annotations

import pytest

from conveyor.common.engine_registry import EngineEntry, EngineLoad, EngineRegistry
from conveyor.gateway.routing.directory import NoEngineAvailable
from conveyor.gateway.routing.policy import prefix_block_hashes
from conveyor.gateway.routing.router import AdaptersNotServed, Router
from conveyor.gateway.routing.settings import RoutingSettings

PROMPT = list(range(100, 148))  # three full 16-token blocks


@pytest.fixture
def registry(redis, prefix):
    return EngineRegistry(redis, prefix=prefix)


@pytest.fixture
def router(redis, prefix):
    settings = RoutingSettings(max_waiting=4, max_kv_usage=0.9, max_imbalance=3)
    return Router.from_settings(redis, settings, prefix=prefix, model="m")


async def engine(registry: EngineRegistry, engine_id: str, *, running: int = 0,
                 waiting: int = 0, held: tuple[str, ...] = (), max_loras: int = 4) -> None:
    load = EngineLoad(running, waiting, lora_adapters=held)
    await registry.heartbeat(EngineEntry(engine_id, f"{engine_id}:50052", "m", load,
                                         max_loras))


async def test_an_engine_holding_the_adapter_is_preferred_over_a_less_loaded_one(
        registry, router):
    await engine(registry, "a")
    await engine(registry, "b", running=2, held=("sql",))
    assert (await router.pick(None, [1, 2, 3], lora="sql")).engine_id == "b"
    assert (await router.pick(None, [4, 5, 6], lora="chat")).engine_id == "a"
    assert (await router.pick(None, [7, 8, 9])).engine_id == "a"


async def test_the_least_loaded_holder_is_preferred(registry, router):
    await engine(registry, "a")
    await engine(registry, "b", running=3, held=("sql",))
    await engine(registry, "c", running=1, held=("sql",))
    assert (await router.pick(None, [1, 2, 3], lora="sql")).engine_id == "c"


@pytest.mark.parametrize("holder", [{"waiting": 5}, {"running": 4}],
                         ids=["overloaded", "much_busier"])
async def test_a_holder_overloaded_or_much_busier_yields_to_the_least_loaded(
        registry, router, holder):
    await engine(registry, "a")
    await engine(registry, "b", held=("sql",), **holder)
    assert (await router.pick(None, [1, 2, 3], lora="sql")).engine_id == "a"


async def test_engines_with_lora_off_never_get_an_adapter_request(registry, router):
    await engine(registry, "off", max_loras=0)  # idle, but serves no adapters
    await engine(registry, "on", running=6)
    picks = {(await router.pick(None, [i], lora="sql")).engine_id for i in range(5)}
    assert picks == {"on"}
    assert (await router.pick(None, [9])).engine_id == "off"
    with pytest.raises(NoEngineAvailable):  # the adapter engine already tried
        await router.pick(None, [1], lora="sql", exclude=["on"])


async def test_no_engine_serving_adapters_is_adapters_not_served(registry, router):
    await engine(registry, "off", max_loras=0)
    with pytest.raises(AdaptersNotServed, match="`sql` is a LoRA adapter"):
        await router.pick(None, [1], lora="sql")
    assert (await router.pick(None, [1])).engine_id == "off"


async def test_a_session_stays_on_its_engine_rather_than_follow_the_adapter(registry, router):
    await engine(registry, "a")
    await engine(registry, "b", running=1)
    assert (await router.pick("s1", PROMPT, lora="sql")).engine_id == "a"
    await engine(registry, "b", running=1, held=("sql",))
    assert (await router.pick("s1", PROMPT, lora="sql")).engine_id == "a"


async def test_prefix_hints_are_per_adapter(registry, router):
    base = prefix_block_hashes(PROMPT, 16, 4, "salt")
    sql = prefix_block_hashes(PROMPT, 16, 4, "salt", "sql")
    chat = prefix_block_hashes(PROMPT, 16, 4, "salt", "chat")
    assert len(base) == len(sql) == 3 and not set(base) & set(sql) and not set(sql) & set(chat)
    assert prefix_block_hashes(PROMPT, 16, 4, "salt", "") == base
    await engine(registry, "a")
    await engine(registry, "b")
    first = (await router.pick(None, PROMPT, lora="sql")).engine_id
    await engine(registry, first, running=2)  # busier, but it served this prompt with sql
    assert (await router.pick(None, PROMPT, lora="sql")).engine_id == first
    assert (await router.pick(None, PROMPT, lora="chat")).engine_id != first
