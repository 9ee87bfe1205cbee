"""Session bindings and prefix hints are compare-and-set in Redis (`EngineBindings`), so
every gateway replica routes a session to the same engine. A pick reads the session's
binding and the prompt's hints in one round trip; the bindings it makes are written
at once, or left pending for its request to write with its settlement (`Router.pick`):

    {prefix}:route:{namespace}:{name}   STRING  engine_id, expires ttl_s after last use"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from conveyor.common.engine_registry import (
    require_decoded_responses,
)
from conveyor.common.redis_scripts import ScriptCall

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

    @property
    def redis(self) -> Redis:
        return self._redis

    def pipeline(self) -> Pipeline:
        """A pipeline (not a transaction) on these bindings' Redis, for `queue_*`."""
        return self._redis.pipeline(transaction=False)

    def queue_get(self, pipe: Pipeline, name: str) -> None:
        """Queue a read of `name`'s binding that refreshes its TTL (its reply: the bound
        engine id, None if unbound)."""
        pipe.getex(self._key(name), px=self._ttl_ms)

    def queue_get_many(self, pipe: Pipeline, names: Sequence[str]) -> None:
        """Queue a read of several (non-empty) names' bindings, no TTL refresh (its reply:
        their engine ids, None where unbound)."""
        pipe.mget([self._key(name) for name in names])

    def bind_call(self, name: str, engine_id: str, *, replacing: str | None = None) -> ScriptCall:
        """Bind `name` to `engine_id` if it is unbound or still bound to `replacing`, as a
        script call to run with others in one round trip (common.redis_scripts); its
        reply: the engine id the name is bound to afterwards (maybe another gateway's
        choice)."""
        return ScriptCall(self._bind, [self._key(name)],
                          [engine_id, replacing or "", self._ttl_ms])

    def _key(self, name: str) -> str:
        return self._key_prefix + name


@dataclass(slots=True)
class PendingBindings:
    """The binding writes a request's last pick left for later (`Router.pick`'s
    `pending`); a later pick of the same request (its stream moved) replaces them."""

    calls: list[ScriptCall] = field(default_factory=list)
