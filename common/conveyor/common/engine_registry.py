"""The engine registry: which engine replicas are alive, where, and how loaded.

Engines write, gateways read. Each engine publishes a heartbeat (its id, gRPC
address, model and current load) every `interval_s`; an entry whose engine
stopped beating is dropped `ttl_s` after its last heartbeat, so a dead engine
leaves the registry within a few seconds without anyone noticing it died.

Redis layout (all under one `prefix`, default "conveyor"):

    {prefix}:engines:entries    HASH  engine_id -> JSON {address, model, load}
    {prefix}:engines:deadlines  ZSET  engine_id -> Redis-clock ms when it expires

Both scripts read the clock with Redis `TIME`, so engines and gateways on hosts
with skewed clocks still agree on who is alive. Listing prunes expired entries
in the same script that reads them, so a heartbeat racing a listing can never
lose a live engine.

The Redis client must be created with `decode_responses=True`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from redis.asyncio import Redis
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 5.0
"""An engine without a heartbeat for this long is considered gone."""

DEFAULT_INTERVAL_S = 1.0
"""How often an engine publishes its heartbeat (well under the TTL)."""

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
for _, engine_id in ipairs(expired) do
  redis.call('HDEL', KEYS[1], engine_id)
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now_ms)
return redis.call('HGETALL', KEYS[1])
"""

_DEREGISTER_LUA = """
redis.call('HDEL', KEYS[1], ARGV[1])
return redis.call('ZREM', KEYS[2], ARGV[1])
"""


@dataclass(slots=True, frozen=True)
class EngineLoad:
    """An engine's load at its last heartbeat (the fields of EngineStats that route)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    """Fraction of KV blocks in use, 0-1."""

    @property
    def num_requests(self) -> int:
        return self.num_running + self.num_waiting


@dataclass(slots=True, frozen=True)
class EngineEntry:
    """One live engine replica as the registry knows it."""

    engine_id: str
    address: str
    """host:port of its gRPC server."""
    model: str
    load: EngineLoad = field(default_factory=EngineLoad)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> EngineEntry:
        data = json.loads(text)
        return cls(data["engine_id"], data["address"], data["model"], EngineLoad(**data["load"]))


def require_decoded_responses(redis: Redis) -> None:
    """Refuse a client that returns bytes: every store here compares str."""
    if not redis.get_connection_kwargs().get("decode_responses"):
        raise ValueError("Conveyor's Redis stores need a client created with "
                         "decode_responses=True (Redis.from_url(url, decode_responses=True))")


class EngineRegistry:
    """Engines register and heartbeat here; routers list the live ones."""

    def __init__(self, redis: Redis, *, prefix: str = "conveyor", ttl_s: float = DEFAULT_TTL_S):
        require_decoded_responses(redis)
        if ttl_s <= 0:
            raise ValueError(f"engine registry ttl_s must be > 0, got {ttl_s}")
        self.ttl_s = ttl_s
        self._keys = [f"{prefix}:engines:entries", f"{prefix}:engines:deadlines"]
        self._heartbeat = redis.register_script(_HEARTBEAT_LUA)
        self._list = redis.register_script(_LIST_LUA)
        self._deregister = redis.register_script(_DEREGISTER_LUA)

    async def heartbeat(self, entry: EngineEntry) -> None:
        """Publish (or first register) `entry`; it stays live for `ttl_s`."""
        ttl_ms = max(1, round(self.ttl_s * 1000))
        await self._heartbeat(keys=self._keys, args=[entry.engine_id, entry.to_json(), ttl_ms])

    async def deregister(self, engine_id: str) -> bool:
        """Remove an engine now (graceful shutdown). True if it was registered."""
        return bool(await self._deregister(keys=self._keys, args=[engine_id]))

    async def list_live(self, model: str | None = None) -> list[EngineEntry]:
        """Engines whose last heartbeat is younger than their TTL, sorted by id."""
        flat = await self._list(keys=self._keys)
        entries = [EngineEntry.from_json(payload) for payload in flat[1::2]]
        if model is not None:
            entries = [e for e in entries if e.model == model]
        return sorted(entries, key=lambda e: e.engine_id)


class EngineHeartbeat:
    """Publishes one engine's entry every `interval_s` until stopped.

    `read_load` is called on the event loop before each heartbeat and must be
    cheap (read counters, no locks). A Redis outage is logged and retried on the
    next beat; it never stops the engine.
    """

    def __init__(self, registry: EngineRegistry, *, engine_id: str, address: str, model: str,
                 read_load: Callable[[], EngineLoad], interval_s: float = DEFAULT_INTERVAL_S):
        if interval_s >= registry.ttl_s:
            raise ValueError(f"heartbeat interval_s ({interval_s}) must be shorter than the "
                             f"registry ttl_s ({registry.ttl_s}) or the engine will flicker")
        self._registry = registry
        self._identity = (engine_id, address, model)
        self._read_load = read_load
        self._interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    @property
    def engine_id(self) -> str:
        return self._identity[0]

    def current_entry(self) -> EngineEntry:
        return EngineEntry(*self._identity, load=self._read_load())

    async def beat(self) -> None:
        """Publish one heartbeat now."""
        await self._registry.heartbeat(self.current_entry())

    async def start(self) -> None:
        """Register now (raising if Redis is unreachable), then beat in the background."""
        await self.beat()
        self._task = asyncio.create_task(self._beat_forever(), name=f"heartbeat-{self.engine_id}")

    async def stop(self) -> None:
        """Stop beating and deregister, so routers stop sending here at once."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        try:
            await self._registry.deregister(self.engine_id)
        except RedisError as exc:
            log.warning("could not deregister engine %s: %s", self.engine_id, exc)

    async def _beat_forever(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.beat()
            except RedisError as exc:
                log.warning("engine heartbeat to Redis failed (retrying): %s", exc)
