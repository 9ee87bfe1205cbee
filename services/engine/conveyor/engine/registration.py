"""The engine's entry in the Redis engine registry, so gateways find and route to it.

Registered once the gRPC server is bound, refreshed by a heartbeat carrying the
load of the loop's latest stats snapshot (the LoRA adapters held among it) and the
facts gateways route and check requests by (max_loras, block_size, max_model_len),
removed on SIGTERM before the drain (`conveyor.common.registration.Registration`,
shared with the tokenizer and detok). Redis is optional: when it cannot be reached
at start, the engine logs a warning, serves anyway (gateways with a static engine
list still reach it) and keeps trying to register in the background.
"""

from __future__ import annotations

import logging

from conveyor.common.engine_registry import (
    EngineEntry,
    EngineHeartbeat,
    EngineLoad,
    EngineRegistry,
)
from conveyor.common.registration import Registration, registry_redis
from conveyor.engine.async_engine import AsyncEngine
from conveyor.engine.servicer import stats_message
from conveyor.engine.settings import EngineSettings

__all__ = ["Registration", "build_registration", "load_of"]

log = logging.getLogger("conveyor.engine.registration")


def build_registration(settings: EngineSettings, engine: AsyncEngine,
                       bound_port: int) -> Registration | None:
    """The engine's registration, or None when `redis_url` is empty (registration off)."""
    if not settings.redis_url:
        log.info("CONVEYOR_ENGINE_REDIS_URL is empty: not registering in an engine registry")
        return None
    redis = registry_redis(settings.redis_url)
    registry = EngineRegistry(redis, prefix=settings.redis_prefix, ttl_s=settings.registry_ttl_s)
    info = engine.info
    entry = EngineEntry(info.engine_id, settings.resolved_advertise_address(bound_port),
                        info.model, max_loras=info.max_loras, block_size=info.block_size,
                        max_model_len=info.max_model_len)
    heartbeat = EngineHeartbeat(registry, entry, read_load=lambda: load_of(engine),
                                interval_s=settings.heartbeat_interval_s)
    return Registration(redis, heartbeat, settings.heartbeat_interval_s)


def load_of(engine: AsyncEngine) -> EngineLoad:
    """The load in the loop's latest stats snapshot (an attribute read, never a lock), as
    Stats answers it: a gateway sees the same load through the registry or by asking."""
    return EngineLoad.from_stats(stats_message(engine.stats()))
