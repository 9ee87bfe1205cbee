"""Which engine replica serves a request.

Order of preference:

1. **Session affinity.** A request with a session key (X-Session-ID, else the
   body's `user`) goes to the engine its session is bound to, which holds the
   conversation's prefix cache. The binding moves only when that engine is gone
   from the registry, or overloaded while another engine is not.
2. **Prefix hint.** Otherwise (and when a session is first bound) the longest
   of the prompt's leading full blocks that some live engine served recently
   sends it there, unless that engine is overloaded or much busier than the
   least loaded one (a hint is only a preference).
3. **Least loaded**, preferring engines that are not overloaded.

Load comes from the engines' heartbeats in the registry (at most one heartbeat
interval old). Session bindings and prefix hints are compare-and-set in Redis,
so every gateway replica routes a session to the same engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from redis.asyncio import Redis

from conveyor.common.engine_registry import EngineEntry, EngineRegistry
from conveyor.gateway.engine_picker import NoEngineAvailable
from conveyor.gateway.routing.engine_bindings import EngineBindings
from conveyor.gateway.routing.load_policy import LoadPolicy
from conveyor.gateway.routing.prefix_hash import prefix_block_hashes
from conveyor.gateway.routing.settings import RoutingSettings

Engines = dict[str, EngineEntry]


class LiveEngines(Protocol):
    """Where the router learns which engines are alive (EngineRegistry, or the
    gateway's directory that falls back to its static engine list)."""

    async def list_live(self, model: str | None = None) -> list[EngineEntry]: ...


class Router:
    """Picks an engine per request; safe to share by all requests of a gateway."""

    def __init__(self, registry: LiveEngines, sessions: EngineBindings,
                 prefixes: EngineBindings, policy: LoadPolicy, *, block_size: int = 16,
                 max_hint_blocks: int = 4, model: str | None = None):
        self._registry = registry
        self._sessions = sessions
        self._prefixes = prefixes
        self._policy = policy
        self._block_size = block_size
        self._max_hint_blocks = max_hint_blocks
        self._model = model

    @classmethod
    def from_settings(cls, redis: Redis, settings: RoutingSettings, *,
                      prefix: str = "conveyor", model: str | None = None,
                      engines: LiveEngines | None = None) -> Router:
        """A router over `redis` configured by the gateway's settings; `model`
        limits it to engines serving that model (None: any); `engines` replaces
        the plain registry as the source of live engines."""
        return cls(
            engines or EngineRegistry(redis, prefix=prefix),
            EngineBindings(redis, "session", prefix=prefix, ttl_s=settings.session_ttl_s),
            EngineBindings(redis, "prefix", prefix=prefix, ttl_s=settings.prefix_hint_ttl_s),
            LoadPolicy(settings.max_waiting, settings.max_kv_usage, settings.max_imbalance),
            block_size=settings.prefix_block_size, max_hint_blocks=settings.prefix_hint_blocks,
            model=model,
        )

    async def pick(self, session_key: str | None, prompt_token_ids: Sequence[int], *,
                   cache_salt: str = "") -> EngineEntry:
        """The engine for this request; NoEngineAvailable when none is registered.
        `cache_salt` is the tenant's prefix-cache salt (hints never cross salts)."""
        engines = {e.engine_id: e for e in await self._registry.list_live(self._model)}
        if not engines:
            raise NoEngineAvailable("no live engine in the registry (engines register in "
                                    "Redis; is one running against the same Redis?)")
        if session_key:
            return await self._pick_for_session(session_key, prompt_token_ids, cache_salt,
                                                engines)
        return await self._pick_by_prefix(prompt_token_ids, cache_salt, engines)

    async def _pick_for_session(self, session_key: str, token_ids: Sequence[int],
                                cache_salt: str, engines: Engines) -> EngineEntry:
        bound = await self._sessions.get(session_key)
        if bound is not None and self._may_stay(bound, engines):
            return engines[bound]
        candidate = await self._pick_by_prefix(token_ids, cache_salt, engines)
        winner = await self._sessions.bind(session_key, candidate.engine_id, replacing=bound)
        return engines.get(winner, candidate)

    def _may_stay(self, engine_id: str, engines: Engines) -> bool:
        """A session stays unless its engine is gone, or overloaded while another is not."""
        engine = engines.get(engine_id)
        if engine is None:
            return False
        overloaded = self._policy.is_overloaded
        return not overloaded(engine) or all(overloaded(e) for e in engines.values())

    async def _pick_by_prefix(self, token_ids: Sequence[int], cache_salt: str,
                              engines: Engines) -> EngineEntry:
        least = self._policy.least_loaded(engines.values())
        hashes = prefix_block_hashes(token_ids, self._block_size, self._max_hint_blocks,
                                     cache_salt)
        if not hashes:
            return least
        seen = await self._prefixes.get_many(hashes)
        chosen = self._hinted_engine(seen, engines, least) or least
        await self._remember_prefixes(hashes, seen, chosen, engines)
        return chosen

    def _hinted_engine(self, seen: list[str | None], engines: Engines,
                       least: EngineEntry) -> EngineEntry | None:
        """The engine hinted for the longest prefix that may take the request."""
        for engine_id in reversed(seen):
            engine = engines.get(engine_id) if engine_id else None
            if engine is not None and not self._policy.is_overloaded(engine) \
                    and not self._policy.is_much_busier(engine, least):
                return engine
        return None

    async def _remember_prefixes(self, hashes: list[str], seen: list[str | None],
                                 chosen: EngineEntry, engines: Engines) -> None:
        """Hint each prefix to `chosen` where it is unhinted, hinted to a gone engine,
        or already `chosen` (refreshing it); other live engines keep their hints."""
        await self._prefixes.bind_many([
            (prefix_hash, chosen.engine_id, engine_id)
            for prefix_hash, engine_id in zip(hashes, seen, strict=True)
            if engine_id is None or engine_id not in engines or engine_id == chosen.engine_id
        ])
