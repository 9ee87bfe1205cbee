"""A registry of live replicas of one service in Redis, kept by heartbeats.

Replicas write, callers read. Each replica publishes a heartbeat (its entry as
JSON) every `interval_s`; an entry whose replica stopped beating is dropped
`ttl_s` after its last heartbeat, so a dead replica leaves the registry within
a few seconds without anyone noticing it died. Engines keep their entries (with
their load) here under the service name "engines" (`engine_registry`); the
tokenizer and detok replicas under "tokenizer" and "detok" (`ReplicaEntry`).

Redis layout (all under one `prefix`, default "conveyor"):

    {prefix}:{service}:entries    HASH  entry_id -> JSON entry
    {prefix}:{service}:deadlines  ZSET  entry_id -> Redis-clock ms when it expires

Both scripts read the clock with Redis `TIME`, so replicas and callers on hosts
with skewed clocks still agree on who is alive. Listing prunes expired entries
in the same script that reads them, so a heartbeat racing a listing can never
lose a live replica.

The Redis client must be created with `decode_responses=True`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Generic, Protocol, TypeVar

from redis.asyncio import Redis
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 5.0
"""A replica without a heartbeat for this long is considered gone."""

DEFAULT_INTERVAL_S = 1.0
"""How often a replica publishes its heartbeat (well under the TTL)."""

_HEARTBEAT_LUA = """
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], now_ms + tonumber(ARGV[3]), ARGV[1])
return now_ms
"""

_LIST_LUA = """
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now_ms)
for _, entry_id in ipairs(expired) do
  redis.call('HDEL', KEYS[1], entry_id)
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now_ms)
return redis.call('HGETALL', KEYS[1])
"""

_DEREGISTER_LUA = """
redis.call('HDEL', KEYS[1], ARGV[1])
return redis.call('ZREM', KEYS[2], ARGV[1])
"""


class RegistryEntry(Protocol):
    """What a registry stores: an id, the model served, and a JSON form."""

    @property
    def entry_id(self) -> str: ...

    @property
    def model(self) -> str: ...

    def to_json(self) -> str: ...

    @classmethod
    def from_json(cls, text: str) -> RegistryEntry: ...


E = TypeVar("E", bound=RegistryEntry)


@dataclass(slots=True, frozen=True)
class ReplicaEntry:
    """One live replica of a stateless service (tokenizer, detok): where it listens
    and what it serves. Its address is its id."""

    address: str
    """host:port of its gRPC server."""
    model: str

    @property
    def entry_id(self) -> str:
        return self.address

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> ReplicaEntry:
        data = json.loads(text)
        return cls(data["address"], data["model"])


def require_decoded_responses(redis: Redis) -> None:
    """Refuse a client that returns bytes: every store here compares str."""
    if not redis.get_connection_kwargs().get("decode_responses"):
        raise ValueError("Conveyor's Redis stores need a client created with "
                         "decode_responses=True (Redis.from_url(url, decode_responses=True))")


class ServiceRegistry(Generic[E]):
    """Replicas of `service` register and heartbeat here; callers list the live ones."""

    def __init__(self, redis: Redis, *, service: str, entry_type: type[E],
                 prefix: str = "conveyor", ttl_s: float = DEFAULT_TTL_S):
        require_decoded_responses(redis)
        if ttl_s <= 0:
            raise ValueError(f"{service} registry ttl_s must be > 0, got {ttl_s}")
        self.service = service
        self.ttl_s = ttl_s
        self._entry_type = entry_type
        self._keys = [f"{prefix}:{service}:entries", f"{prefix}:{service}:deadlines"]
        self._heartbeat = redis.register_script(_HEARTBEAT_LUA)
        self._list = redis.register_script(_LIST_LUA)
        self._deregister = redis.register_script(_DEREGISTER_LUA)

    async def heartbeat(self, entry: E) -> None:
        """Publish (or first register) `entry`; it stays live for `ttl_s`."""
        ttl_ms = max(1, round(self.ttl_s * 1000))
        await self._heartbeat(keys=self._keys, args=[entry.entry_id, entry.to_json(), ttl_ms])

    async def deregister(self, entry_id: str) -> bool:
        """Remove a replica now (graceful shutdown). True if it was registered."""
        return bool(await self._deregister(keys=self._keys, args=[entry_id]))

    async def list_live(self, model: str | None = None) -> list[E]:
        """Replicas whose last heartbeat is younger than their TTL, sorted by id."""
        flat = await self._list(keys=self._keys)
        entries = [self._entry_type.from_json(payload) for payload in flat[1::2]]
        if model is not None:
            entries = [e for e in entries if e.model == model]
        return sorted(entries, key=lambda e: e.entry_id)


class Heartbeat(Generic[E]):
    """Publishes one replica's entry every `interval_s` until stopped.

    `read_entry` is called on the event loop before each heartbeat and must be
    cheap (read counters, no locks); its id must not change. A Redis outage is
    logged and retried on the next beat; it never stops the replica.
    """

    def __init__(self, registry: ServiceRegistry[E], read_entry: Callable[[], E],
                 interval_s: float = DEFAULT_INTERVAL_S):
        if interval_s >= registry.ttl_s:
            raise ValueError(f"heartbeat interval_s ({interval_s}) must be shorter than the "
                             f"registry ttl_s ({registry.ttl_s}) or the replica will flicker")
        self._registry = registry
        self._read_entry = read_entry
        self._interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    @property
    def entry_id(self) -> str:
        return self._read_entry().entry_id

    def current_entry(self) -> E:
        return self._read_entry()

    async def beat(self) -> None:
        """Publish one heartbeat now."""
        await self._registry.heartbeat(self.current_entry())

    async def start(self) -> None:
        """Register now (raising if Redis is unreachable), then beat in the background."""
        await self.beat()
        self._task = asyncio.create_task(
            self._beat_forever(), name=f"heartbeat-{self._registry.service}-{self.entry_id}")

    async def stop(self) -> None:
        """Stop beating and deregister, so callers stop sending here at once."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        try:
            await self._registry.deregister(self.entry_id)
        except RedisError as exc:
            log.warning("could not deregister %s %s: %s", self._registry.service,
                        self.entry_id, exc)

    async def _beat_forever(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.beat()
            except RedisError as exc:
                log.warning("%s heartbeat to Redis failed (retrying): %s",
                            self._registry.service, exc)
