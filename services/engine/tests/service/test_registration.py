"""The engine's registry entry over the real Redis: settings, register with the loop's load,
leave on stop, and serve on (retrying) when Redis cannot be reached."""

from __future__ import annotations

import asyncio
import logging
import socket
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from conveyor.common.engine_registry import EngineLoad, EngineRegistry
from conveyor.engine.engine_stats import EngineStats
from conveyor.engine.registration import build_registration
from conveyor.engine.settings import EngineSettings


def _settings(**values) -> EngineSettings:
    return EngineSettings(**{"heartbeat_interval_s": 0.1, "registry_ttl_s": 1.0, **values})


def _engine(stats: EngineStats, max_loras: int = 0):
    info = SimpleNamespace(engine_id="engine-under-test", model="tiny", max_loras=max_loras,
                           block_size=32, max_model_len=512)
    return SimpleNamespace(info=info, stats=lambda: stats)


def test_advertise_address_defaults_to_the_bound_host_and_port():
    assert _settings(host="127.0.0.1").resolved_advertise_address(5001) == "127.0.0.1:5001"
    hostname = socket.gethostname()
    assert _settings(host="0.0.0.0").resolved_advertise_address(5001) == f"{hostname}:5001"
    assert _settings(advertise_address="engine-3:50052").resolved_advertise_address(1) == \
        "engine-3:50052"


def test_a_heartbeat_slower_than_the_ttl_names_both_settings():
    with pytest.raises(ValidationError, match="CONVEYOR_ENGINE_REGISTRY_TTL_S"):
        _settings(heartbeat_interval_s=5, registry_ttl_s=5)


def test_an_empty_redis_url_turns_registration_off():
    assert build_registration(_settings(redis_url=""), _engine(EngineStats()), 1) is None


async def test_registers_with_the_loop_load_and_leaves_on_stop(redis, prefix):
    stats = EngineStats(num_running=2, num_waiting=1, num_free_blocks=3, num_blocks=4,
                        num_waiting_tokens=40, max_num_waiting_seqs=8,
                        max_num_waiting_tokens=512)
    settings = _settings(redis_url="redis://127.0.0.1:6379/0", redis_prefix=prefix)
    entry = build_registration(settings, _engine(stats), 7001)
    registry = EngineRegistry(redis, prefix=prefix)
    await entry.start()
    [live] = await registry.list_live("tiny")
    assert (live.engine_id, live.address) == ("engine-under-test", "127.0.0.1:7001")
    assert (live.block_size, live.max_model_len) == (32, 512)
    assert live.load == EngineLoad(2, 1, 0.25, num_free_blocks=3, num_blocks=4,
                                   num_waiting_tokens=40, max_num_waiting_seqs=8,
                                   max_num_waiting_tokens=512)
    assert not live.load.is_waiting_full
    await entry.stop()
    assert await registry.list_live() == []


async def test_the_entry_carries_max_loras_and_the_adapters_held(redis, prefix):
    settings = _settings(redis_url="redis://127.0.0.1:6379/0", redis_prefix=prefix)
    entry = build_registration(settings, _engine(EngineStats(lora_adapters=("sql",)), 4), 7003)
    await entry.start()
    [live] = await EngineRegistry(redis, prefix=prefix).list_live("tiny")
    await entry.stop()
    assert live.max_loras == 4 and live.load.lora_adapters == ("sql",)


async def test_unreachable_redis_warns_and_the_engine_serves_on(caplog):
    settings = _settings(redis_url="redis://127.0.0.1:1/0")
    entry = build_registration(settings, _engine(EngineStats()), 7002)
    with caplog.at_level(logging.WARNING, logger="conveyor.engine.registration"):
        await asyncio.wait_for(entry.start(), timeout=5)
    assert "serving without registration" in caplog.text
    await asyncio.wait_for(entry.stop(), timeout=10)
