"""The engine's entry in the Redis engine registry, so gateways find and route to it.

Registered once the gRPC server is bound, refreshed by a heartbeat carrying the
load of the loop's latest stats snapshot, removed on SIGTERM before the drain.
Redis is optional: when it cannot be reached at start, the engine logs a warning,
serves anyway (gateways with a static engine list still reach it) and keeps
trying to register in the background.
"""

from __future__ import annotations

import asyncio
import logging

from redis.asyncio import Redis
from redis.exceptions import RedisError

from conveyor.common.engine_registry import EngineHeartbeat, EngineLoad, EngineRegistry
from conveyor.engine.async_engine import AsyncEngine
from conveyor.engine.settings import EngineSettings

log = logging.getLogger("conveyor.engine.registration")

CONNECT_TIMEOUT_S = 2.0
"""How long one Redis connection attempt may take (a start never hangs on it)."""


class Registration:
    """This engine's registry entry: `start` registers (or keeps trying), `stop` leaves."""

    def __init__(self, redis: Redis, heartbeat: EngineHeartbeat, retry_s: float):
        self._redis = redis
        self._heartbeat = heartbeat
        self._retry_s = retry_s
        self._retrying: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Register now; if Redis is unreachable, warn and retry in the background."""
        try:
            await self._heartbeat.start()
        except (RedisError, OSError) as exc:
            log.warning("engine registry at Redis unreachable (%s): serving without "
                        "registration, retrying every %.1fs; gateways with static engine "
                        "addresses still reach this engine", exc, self._retry_s)
            self._retrying = asyncio.create_task(self._register_when_reachable())
            return
        log.info("registered as %s", self._heartbeat.current_entry())

    async def stop(self) -> None:
        """Leave the registry now (before draining) and close the connection."""
        if self._retrying is not None:
            self._retrying.cancel()
            await asyncio.gather(self._retrying, return_exceptions=True)
        await self._heartbeat.stop()
        await self._redis.aclose()

    async def _register_when_reachable(self) -> None:
        while True:
            await asyncio.sleep(self._retry_s)
            try:
                await self._heartbeat.start()
            except (RedisError, OSError):
                continue
            log.info("registered as %s (Redis is reachable again)",
                     self._heartbeat.current_entry())
            return


def build_registration(settings: EngineSettings, engine: AsyncEngine,
                       bound_port: int) -> Registration | None:
    """The engine's registration, or None when `redis_url` is empty (registration off)."""
    if not settings.redis_url:
        log.info("CONVEYOR_ENGINE_REDIS_URL is empty: not registering in an engine registry")
        return None
    redis = Redis.from_url(settings.redis_url, decode_responses=True,
                           socket_connect_timeout=CONNECT_TIMEOUT_S,
                           socket_timeout=CONNECT_TIMEOUT_S)
    registry = EngineRegistry(redis, prefix=settings.redis_prefix, ttl_s=settings.registry_ttl_s)
    heartbeat = EngineHeartbeat(
        registry, engine_id=engine.info.engine_id,
        address=settings.resolved_advertise_address(bound_port), model=engine.info.model,
        read_load=lambda: load_of(engine), interval_s=settings.heartbeat_interval_s)
    return Registration(redis, heartbeat, settings.heartbeat_interval_s)


def load_of(engine: AsyncEngine) -> EngineLoad:
    """The load in the loop's latest stats snapshot (an attribute read, never a lock)."""
    stats = engine.stats()
    return EngineLoad(stats.num_running, stats.num_waiting, stats.kv_usage)
