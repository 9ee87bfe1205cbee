"""Routing: which engine replica serves a request (`Router.pick`).

Order of preference when picking:

1. **Session affinity.** A request with a session key (X-Session-ID, else the body's
   `prompt_cache_key`, else its `user`) goes to the engine its session is bound to,
   which holds the conversation's prefix cache. The binding moves only when that engine is gone
   from the registry, or overloaded while another engine is not.
2. **Prefix hint.** Otherwise (and when a session is first bound) the longest
   of the prompt's leading full blocks (in the block size the engines publish:
   policy.hint_block_size) that some live engine served recently sends it there,
   unless that engine is overloaded or much busier than the least loaded one (a
   hint is only a preference).
3. **Adapter held.** A request naming a LoRA adapter goes to the least loaded engine
   that holds it in memory (engines list theirs with their load), on the same terms as
   a hint; else the engine picked by load reads the adapter from the request's path.
4. **Least loaded**, preferring engines that are not overloaded.

Only engines serving the requested model are candidates, and for an adapter request
only those serving adapters (max_loras > 0): when engines serve the model but none
serves adapters, the pick fails with `AdaptersNotServed` (a 400: retrying does not
help until engines run with LoRA on). Which engines are live is directory.py's, the
bindings bindings.py's, when an engine is too busy policy.py's."""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from typing import Protocol

from redis.asyncio import Redis
from redis.exceptions import RedisError

from conveyor.common.engine_registry import (
    DEFAULT_INTERVAL_S,
    EngineEntry,
    EngineRegistry,
)
from conveyor.common.redis_scripts import ScriptCall, run_script_calls
from conveyor.gateway.routing.bindings import EngineBindings, PendingBindings
from conveyor.gateway.routing.directory import NoEngineAvailable
from conveyor.gateway.routing.policy import (
    LoadPolicy,
    RecentPicks,
    hint_block_size,
    prefix_block_hashes,
)
from conveyor.gateway.routing.settings import RoutingSettings

log = logging.getLogger("conveyor.gateway.routing")


class AdaptersNotServed(Exception):
    """A request names a LoRA adapter, and the live engines of its model serve none."""

    def __init__(self, adapter: str):
        super().__init__(f"The model `{adapter}` is a LoRA adapter, and no engine serving its "
                         "base model serves adapters; run engines with "
                         "CONVEYOR_ENGINE_ENABLE_LORA=true to use it.")
        self.adapter = adapter


Engines = dict[str, EngineEntry]


class LiveEngines(Protocol):
    """Where the router learns which engines are alive (EngineRegistry, or the
    gateway's directory that falls back to its static engine list)."""

    async def list_live(self, model: str | None = None) -> list[EngineEntry]: ...


class Router:
    """Picks an engine per request; safe to share by all requests of a gateway."""

    def __init__(self, registry: LiveEngines, sessions: EngineBindings,
                 prefixes: EngineBindings, policy: LoadPolicy, *,
                 max_hint_blocks: int = 4, model: str | None = None,
                 recent_window_s: float = 2 * DEFAULT_INTERVAL_S):
        self._registry = registry
        self._sessions = sessions
        self._prefixes = prefixes
        self._policy = policy
        self._max_hint_blocks = max_hint_blocks
        self._model = model
        self._recent = RecentPicks(recent_window_s)

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
            max_hint_blocks=settings.prefix_hint_blocks, model=model,
            recent_window_s=DEFAULT_INTERVAL_S + settings.engine_list_max_age_s,
        )

    async def live_engines(self, model: str | None = None,
                           lora: str | None = None) -> list[EngineEntry]:
        """The live engines serving `model` (else the router's own model, else any); for
        a request naming LoRA adapter `lora`, those serving adapters, and
        AdaptersNotServed when engines serve the model but none serves adapters."""
        engines = await self._registry.list_live(model or self._model)
        if lora is None:
            return engines
        serving = [e for e in engines if e.serves_adapters]
        if engines and not serving:
            raise AdaptersNotServed(lora)
        return serving

    async def pick(self, session_key: str | None, prompt_token_ids: Sequence[int], *,
                   cache_salt: str = "", model: str | None = None, lora: str | None = None,
                   exclude: Collection[str] = (),
                   pending: PendingBindings | None = None) -> EngineEntry:
        """The engine for this request; NoEngineAvailable when none serving `model` (else
        the router's own model, else any) is live. `cache_salt` is the tenant's
        prefix-cache salt (hints never cross salts); `lora` the adapter the request
        names (None: the base model; see `live_engines`); engines in `exclude` (ids this
        request already tried) are not candidates.

        Reading the session's binding and the prompt's hints is one Redis round trip.
        The bindings the pick makes (a new or moved session, prefix hints) are written
        at once (a second round trip, and a session then goes where racing gateways
        agreed), or, with `pending`, left there for the caller to write later: a
        request writes them with its settlement, so two gateways racing on a session's
        first requests may each serve one on its own engine, and the session's next
        request goes where the first write put it."""
        model = model or self._model
        engines = {e.engine_id: self._recent.counted_in(e)
                   for e in await self.live_engines(model, lora) if e.engine_id not in exclude}
        if not engines:
            serving = f" serving {model!r}" if model else ""
            adapters = " with LoRA adapters on" if lora else ""
            raise NoEngineAvailable(f"no live engine{serving}{adapters} (engines register in "
                                    "Redis; is one running against the same Redis and prefix?)")
        try:
            chosen = await self._choose(session_key, prompt_token_ids, cache_salt, lora,
                                        engines, pending)
        except RedisError as error:  # bindings and hints are preferences: do without them
            log.warning("session bindings unavailable, routing by load: %s", error)
            chosen = self._by_load(engines, lora)
        self._recent.add(chosen.engine_id)
        return chosen

    async def _choose(self, session_key: str | None, token_ids: Sequence[int], cache_salt: str,
                      lora: str | None, engines: Engines,
                      pending: PendingBindings | None) -> EngineEntry:
        hashes = prefix_block_hashes(token_ids, hint_block_size(engines.values()),
                                     self._max_hint_blocks, cache_salt, lora or "")
        bound, seen = await self._read_bindings(session_key, hashes)
        if bound is not None and self._may_stay(bound, engines):
            chosen, writes = engines[bound], []
        else:
            least = self._policy.least_loaded(engines.values())
            chosen = self._hinted_engine(seen, engines, least) or self._by_load(engines, lora)
            writes = self._prefix_writes(hashes, seen, chosen, engines)
            if session_key:
                writes.insert(0, self._sessions.bind_call(session_key, chosen.engine_id,
                                                          replacing=bound))
        if pending is not None:
            pending.calls = writes
        elif writes:
            replies = await run_script_calls(self._sessions.redis, writes)
            if session_key:
                return engines.get(replies[0], chosen)
        return chosen

    async def _read_bindings(self, session_key: str | None,
                             hashes: list[str]) -> tuple[str | None, list[str | None]]:
        """The session's bound engine (its TTL refreshed) and each prefix's hinted one."""
        if not session_key and not hashes:
            return None, []
        async with self._sessions.pipeline() as pipe:
            if session_key:
                self._sessions.queue_get(pipe, session_key)
            if hashes:
                self._prefixes.queue_get_many(pipe, hashes)
            replies = await pipe.execute()
        bound = replies.pop(0) if session_key else None
        return bound, replies[0] if hashes else []

    def _may_stay(self, engine_id: str, engines: Engines) -> bool:
        """A session stays unless its engine is gone, or overloaded while another is not."""
        engine = engines.get(engine_id)
        if engine is None:
            return False
        overloaded = self._policy.is_overloaded
        return not overloaded(engine) or all(overloaded(e) for e in engines.values())

    def _hinted_engine(self, seen: list[str | None], engines: Engines,
                       least: EngineEntry) -> EngineEntry | None:
        """The engine hinted for the longest prefix that may take the request."""
        for engine_id in reversed(seen):
            engine = engines.get(engine_id) if engine_id else None
            if engine is not None and self._policy.may_prefer(engine, least):
                return engine
        return None

    def _by_load(self, engines: Engines, lora: str | None) -> EngineEntry:
        """The least loaded engine holding adapter `lora` if it may take the request,
        else the least loaded one."""
        least = self._policy.least_loaded(engines.values())
        holding = [e for e in engines.values() if lora and lora in e.load.lora_adapters]
        if holding:
            holder = self._policy.least_loaded(holding)
            if self._policy.may_prefer(holder, least):
                return holder
        return least

    def _prefix_writes(self, hashes: list[str], seen: list[str | None],
                       chosen: EngineEntry, engines: Engines) -> list[ScriptCall]:
        """Hint each prefix to `chosen` where it is unhinted, hinted to a gone engine,
        or already `chosen` (refreshing it); other live engines keep their hints."""
        return [self._prefixes.bind_call(prefix_hash, chosen.engine_id, replacing=engine_id)
                for prefix_hash, engine_id in zip(hashes, seen, strict=True)
                if engine_id is None or engine_id not in engines
                or engine_id == chosen.engine_id]
