"""Name -> engine id bindings in Redis that every gateway replica agrees on.

Session affinity (name = session key) and prefix hints (name = prefix hash)
are both such bindings, each under its own namespace and TTL:

    {prefix}:route:{namespace}:{name}   STRING  engine_id, expires ttl_s after last use

Agreement comes from compare-and-set: `bind(name, engine, replacing=seen)`
only writes if the binding is still what the caller saw (or has expired), and
otherwise returns the binding another gateway wrote first. So two gateways
that race to bind (or rebind) a name both end up with the same engine.
"""

from __future__ import annotations

from collections.abc import Sequence

from redis.asyncio import Redis

from conveyor.common.engine_registry import require_decoded_responses

_BIND_LUA = """
-- KEYS: the binding; ARGV: 1 engine id, 2 the engine id the caller saw ('' for none), 3 ttl ms
local current = redis.call('GET', KEYS[1])
if not current or current == ARGV[2] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
  return ARGV[1]
end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return current
"""


class EngineBindings:
    """One namespace of bindings with one TTL, refreshed on every use."""

    def __init__(self, redis: Redis, namespace: str, *, prefix: str = "conveyor",
                 ttl_s: float):
        require_decoded_responses(redis)
        self._redis = redis
        self._key_prefix = f"{prefix}:route:{namespace}:"
        self._ttl_ms = max(1, round(ttl_s * 1000))
        self._bind = redis.register_script(_BIND_LUA)

    async def get(self, name: str) -> str | None:
        """The bound engine id, refreshing the binding's TTL; None if unbound."""
        return await self._redis.getex(self._key(name), px=self._ttl_ms)

    async def get_many(self, names: Sequence[str]) -> list[str | None]:
        """Bound engine ids of several names (no TTL refresh), None where unbound."""
        if not names:
            return []
        return await self._redis.mget([self._key(name) for name in names])

    async def bind(self, name: str, engine_id: str, *, replacing: str | None = None) -> str:
        """Bind `name` to `engine_id` if it is unbound or still bound to `replacing`;
        returns the engine id the name is bound to afterwards (maybe another
        gateway's choice)."""
        return await self._bind(keys=[self._key(name)],
                                args=[engine_id, replacing or "", self._ttl_ms])

    async def bind_many(self, bindings: Sequence[tuple[str, str, str | None]]) -> list[str]:
        """`bind` for several (name, engine_id, replacing) in one round trip."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for name, engine_id, replacing in bindings:
                await self._bind(keys=[self._key(name)],
                                 args=[engine_id, replacing or "", self._ttl_ms], client=pipe)
            return await pipe.execute()

    async def unbind(self, name: str) -> None:
        await self._redis.delete(self._key(name))

    def _key(self, name: str) -> str:
        return self._key_prefix + name
