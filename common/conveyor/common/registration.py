"""A replica's entry in its service registry, kept while the process serves.

Registered once the gRPC server is bound, refreshed by a heartbeat, removed on
SIGTERM before the drain (so callers stop sending new calls at once). Redis is
optional: when it cannot be reached at start, the replica logs a warning, serves
anyway (callers with static addresses still reach it) and keeps trying to
register in the background.
"""

from __future__ import annotations

import asyncio
import logging

from redis.asyncio import Redis
from redis.exceptions import RedisError

from conveyor.common.registration_settings import RegistrationSettings
from conveyor.common.service_registry import Heartbeat, ReplicaEntry, ServiceRegistry

log = logging.getLogger("conveyor.registration")

CONNECT_TIMEOUT_S = 2.0
"""How long one Redis connection attempt may take (a start never hangs on it)."""


class Registration:
    """One replica's registry entry: `start` registers (or keeps trying), `stop` leaves."""

    def __init__(self, redis: Redis, heartbeat: Heartbeat, retry_s: float):
        self._redis = redis
        self._heartbeat = heartbeat
        self._retry_s = retry_s
        self._retrying: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Register now; if Redis is unreachable, warn and retry in the background."""
        try:
            await self._heartbeat.start()
        except (RedisError, OSError) as exc:
            log.warning("registry at Redis unreachable (%s): serving without registration, "
                        "retrying every %.1fs; callers with static addresses still reach "
                        "this replica", exc, self._retry_s)
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


def registry_redis(redis_url: str) -> Redis:
    """A Redis client for a replica's registration: short timeouts, decoded responses."""
    return Redis.from_url(redis_url, decode_responses=True,
                          socket_connect_timeout=CONNECT_TIMEOUT_S,
                          socket_timeout=CONNECT_TIMEOUT_S)


def replica_registration(service: str, settings: RegistrationSettings, model: str,
                         bound_port: int) -> Registration | None:
    """The registration of a tokenizer or detok replica (`service`), or None when its
    `redis_url` is empty (registration off)."""
    if not settings.redis_url:
        log.info("%s: redis_url is empty: not registering in a service registry", service)
        return None
    redis = registry_redis(settings.redis_url)
    registry = ServiceRegistry(redis, service=service, entry_type=ReplicaEntry,
                               prefix=settings.redis_prefix, ttl_s=settings.registry_ttl_s)
    entry = ReplicaEntry(settings.resolved_advertise_address(bound_port), model)
    heartbeat = Heartbeat(registry, lambda: entry, settings.heartbeat_interval_s)
    return Registration(redis, heartbeat, settings.heartbeat_interval_s)
