"""Routing: which engine replica serves a request, and the clients that reach engines.

Order of preference when picking:

1. **Session affinity.** A request with a session key (X-Session-ID, else the body's
   `prompt_cache_key`, else its `user`) goes to the engine its session is bound to,
   which holds the conversation's prefix cache. The binding moves only when that engine is gone
   from the registry, or overloaded while another engine is not.
2. **Prefix hint.** Otherwise (and when a session is first bound) the longest
   of the prompt's leading full blocks that some live engine served recently
   sends it there, unless that engine is overloaded or much busier than the
   least loaded one (a hint is only a preference).
3. **Adapter held.** A request naming a LoRA adapter goes to the least loaded engine
   that holds it in memory (engines list theirs with their load), on the same terms as
   a hint; else the engine picked by load reads the adapter from the request's path.
4. **Least loaded**, preferring engines that are not overloaded.

Only engines serving the requested model are candidates, and for an adapter request
only those serving adapters (max_loras > 0): when engines serve the model but none
serves adapters, the pick fails with `AdaptersNotServed` (a 400: retrying does not
help until engines run with LoRA on). Which engines are live:
those registered in Redis (`--scale engine=N`; their load comes with their
heartbeat, at most one interval old) are the truth; while none has registered, the
configured addresses stand in (`StaticEngines`: live while they answer Stats, under
the id their Info reports, so session bindings read the same either way). The list is
read once per heartbeat interval for all requests of a gateway, and an engine a
request could not reach is left out for one registry TTL (`EngineDirectory`).

Session bindings and prefix hints are compare-and-set in Redis (`EngineBindings`), so
every gateway replica routes a session to the same engine. A pick reads the session's
binding and the prompt's hints in one round trip; the bindings it makes are written
at once, or left pending for its request to write with its settlement (`Router.pick`):

    {prefix}:route:{namespace}:{name}   STRING  engine_id, expires ttl_s after last use

Prefix hints hash a prompt's leading full blocks chained like the engine's block
hashes (block i's hash covers the cache salt and every token up to the end of block
i), so equal hashes mean equal prefixes within one salt: tenants with different salts
never share hints, as they never share cached blocks. The adapter's name is part of the
salt for the same reason (a prompt under another adapter, or the base model, is
another prefix to the engine).

One gRPC client per engine address (`EngineClients`) is opened the first time a
request goes there and kept, as gRPC channels reconnect by themselves.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from array import array
from collections import deque
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.exceptions import RedisError

from conveyor.common.engine_registry import (
    DEFAULT_INTERVAL_S,
    DEFAULT_TTL_S,
    EngineEntry,
    EngineLoad,
    EngineRegistry,
    require_decoded_responses,
)
from conveyor.common.left_out import LeftOut
from conveyor.common.redis_scripts import ScriptCall, run_script_calls
from conveyor.gateway.clients.engine import EngineClient, EngineFacts
from conveyor.gateway.clients.upstream import UpstreamError
from conveyor.gateway.routing.settings import RoutingSettings

log = logging.getLogger("conveyor.gateway.routing")



# -- engine clients ----------------------------------------------------------------------







# -- the configured engines (while none registered) --------------------------------------

class NoEngineAvailable(Exception):
    """No live engine serves the request (`Router.pick`); the caller should retry later."""


class AdaptersNotServed(Exception):
    """A request names a LoRA adapter, and the live engines of its model serve none."""

    def __init__(self, adapter: str):
        super().__init__(f"The model `{adapter}` is a LoRA adapter, and no engine serving its "
                         "base model serves adapters; run engines with "
                         "CONVEYOR_ENGINE_ENABLE_LORA=true to use it.")
        self.adapter = adapter


class EnginePicker:
    """The configured engines' loads as Stats answers them, asked once per `max_age_s`
    for all requests."""

    def __init__(self, engines: list[EngineClient], stats_timeout_s: float,
                 max_age_s: float = 0.25):
        if not engines:
            raise ValueError("no engine addresses; set CONVEYOR_GATEWAY_ENGINE_ADDRESSES")
        self.engines = engines
        self._stats_timeout_s = stats_timeout_s
        self._max_age_s = max_age_s
        self._loads: list[EngineLoad | None] = []
        self._loads_at = float("-inf")
        self._round: asyncio.Future | None = None

    async def loads(self) -> list[EngineLoad | None]:
        """Each engine's load (None: did not answer), at most max_age_s old."""
        loop = asyncio.get_running_loop()
        if loop.time() - self._loads_at > self._max_age_s:
            if self._round is None or self._round.done():
                self._round = asyncio.ensure_future(self._ask_all())
            # Shielded: a request that is cancelled must not cancel the shared round.
            self._loads = await asyncio.shield(self._round)
            self._loads_at = loop.time()
        return self._loads

    async def _ask_all(self) -> list[EngineLoad | None]:
        return list(await asyncio.gather(*(self._load_of(e) for e in self.engines)))

    async def _load_of(self, engine: EngineClient) -> EngineLoad | None:
        try:
            return await engine.stats(timeout_s=self._stats_timeout_s)
        except UpstreamError as error:
            log.warning("engine %s did not answer Stats: %s", engine.address, error)
            return None


class StaticEngines:
    """Live entries of the engines a picker knows, with their Stats load."""

    def __init__(self, picker: EnginePicker):
        self._picker = picker
        self._facts: dict[str, EngineFacts] = {}
        """Info per address, forgotten when the engine stops answering (it may restart
        with another id)."""

    async def list_live(self, model: str | None = None) -> list[EngineEntry]:
        answering = []
        for engine, load in zip(self._picker.engines, await self._picker.loads(), strict=True):
            if load is None:
                self._facts.pop(engine.address, None)
            else:
                answering.append((engine, load))
        facts = await asyncio.gather(*(self._facts_of(e) for e, _ in answering))
        entries = [
            EngineEntry(fact.engine_id or engine.address, engine.address, fact.model, load,
                        fact.max_loras)
            for (engine, load), fact in zip(answering, facts, strict=True) if fact is not None
        ]
        return [e for e in entries if model is None or e.model == model]

    async def _facts_of(self, engine: EngineClient) -> EngineFacts | None:
        facts = self._facts.get(engine.address)
        if facts is None:
            try:
                facts = self._facts[engine.address] = await engine.info()
            except UpstreamError:
                return None
        return facts


# -- live engines ------------------------------------------------------------------------

class EngineDirectory:
    """Live engines for the router (see routing.router.LiveEngines).

    The registry's list is kept for `max_age_s` (one heartbeat interval by default) and
    shared by every request of the gateway: one fetch at a time refreshes it, so engines
    cost one Redis round trip per interval, not one per request. A listing is thus at
    most max_age_s + one heartbeat interval old: an engine that registers gets requests
    within that, and one that left without a goodbye is routed around once a request
    finds it unreachable (`mark_unreachable`)."""

    def __init__(self, registry: EngineRegistry, static: StaticEngines | None,
                 unreachable_for_s: float = DEFAULT_TTL_S, max_age_s: float = DEFAULT_INTERVAL_S):
        self._registry = registry
        self._static = static
        self._left_out = LeftOut(unreachable_for_s)
        self._max_age_s = max_age_s
        self._listed: list[EngineEntry] = []
        self._listed_at = float("-inf")
        self._fetch: asyncio.Future[list[EngineEntry]] | None = None

    async def list_live(self, model: str | None = None) -> list[EngineEntry]:
        """Registered engines, or the static ones when none registered; minus those
        marked unreachable. While Redis is unavailable: the engines it listed last (their
        loads as they were), else the static ones."""
        entries = [e for e in await self._registered() if model is None or e.model == model]
        if not entries and self._static is not None:
            entries = await self._static.list_live(model)
        return [e for e in entries if e.engine_id not in self._left_out]

    def mark_unreachable(self, engine_id: str) -> None:
        """A request could not reach this engine: route around it for a while."""
        self._left_out.mark(engine_id)

    async def _registered(self) -> list[EngineEntry]:
        """The registry's live engines, at most max_age_s old."""
        if time.monotonic() - self._listed_at >= self._max_age_s:
            if self._fetch is None or self._fetch.done():
                self._fetch = asyncio.ensure_future(self._list_registered())
            # Shielded: a request that is cancelled must not cancel the shared fetch.
            await asyncio.shield(self._fetch)
        return self._listed

    async def _list_registered(self) -> list[EngineEntry]:
        try:
            self._listed = await self._registry.list_live()
        except RedisError as error:  # asked again after max_age_s, not by every request
            log.warning("engine registry unavailable, routing with what it listed last: %s",
                        error)
        self._listed_at = time.monotonic()
        return self._listed


# -- bindings, load policy, prefix hashes ------------------------------------------------

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


@dataclass(slots=True, frozen=True)
class LoadPolicy:
    """Bounds on an engine's load from its last heartbeat."""

    max_waiting: int = 8
    """More requests waiting than this: overloaded."""
    max_kv_usage: float = 0.95
    """More of the KV cache in use than this (0-1): overloaded."""
    max_imbalance: int = 8
    """A soft preference (a prefix hint) yields once its engine has this many more
    requests than the least loaded engine."""

    def is_full(self, engine: EngineEntry) -> bool:
        """At the engine's own waiting bound (max_num_waiting_seqs/_tokens): it would
        shed the next request of its lowest priority. The one notion of "full"."""
        return engine.load.is_waiting_full

    def is_overloaded(self, engine: EngineEntry) -> bool:
        """Full, or busy: more waiting than max_waiting (the gateway's softer bound,
        past which sessions and hints move to an engine that is not), or its KV nearly
        all in use."""
        return self.is_full(engine) or engine.load.num_waiting > self.max_waiting or \
            engine.load.kv_usage > self.max_kv_usage

    def least_loaded(self, engines: Iterable[EngineEntry]) -> EngineEntry:
        """The engine with the fewest requests (then least KV in use), preferring
        engines that are not full, then not overloaded; ties go to the smaller id."""
        return min(engines, key=lambda e: (self.is_full(e), self.is_overloaded(e),
                                           e.load.num_requests, e.load.kv_usage,
                                           e.engine_id))

    def is_much_busier(self, engine: EngineEntry, least: EngineEntry) -> bool:
        return engine.load.num_requests - least.load.num_requests > self.max_imbalance

    def may_prefer(self, engine: EngineEntry, least: EngineEntry) -> bool:
        """A soft preference (a hint, an adapter held) may send a request to `engine`:
        it is neither overloaded nor much busier than `least`."""
        return not self.is_overloaded(engine) and not self.is_much_busier(engine, least)


def prefix_block_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int,
                        cache_salt: str = "", lora_name: str = "") -> list[str]:
    """Hex hashes of the first min(max_blocks, len // block_size) block prefixes,
    shortest prefix first, under the salt and the LoRA adapter (none: the base model)."""
    num_blocks = min(max_blocks, len(token_ids) // block_size)
    hashes: list[str] = []
    parent = hashlib.blake2b(cache_salt.encode(), digest_size=16).digest()
    if lora_name:
        parent = hashlib.blake2b(parent + b"lora:" + lora_name.encode(), digest_size=16).digest()
    for i in range(num_blocks):
        block = array("q", token_ids[i * block_size:(i + 1) * block_size]).tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        hashes.append(parent.hex())
    return hashes


# -- the router --------------------------------------------------------------------------

Engines = dict[str, EngineEntry]


class LiveEngines(Protocol):
    """Where the router learns which engines are alive (EngineRegistry, or the
    gateway's directory that falls back to its static engine list)."""

    async def list_live(self, model: str | None = None) -> list[EngineEntry]: ...


class RecentPicks:
    """The engines this gateway picked within the last `window_s`.

    Loads come from heartbeats, up to one interval old (and listed up to
    EngineDirectory's max_age_s before that), so a burst would otherwise pile onto the
    engine that looked least loaded (ties going to the smaller id). A recent pick counts
    as one more waiting request of its engine until a listing that has surely seen it is
    in use, so the requests of a burst spread over engines of equal load.
    """

    def __init__(self, window_s: float = 2 * DEFAULT_INTERVAL_S):
        self._window_s = window_s
        self._times: dict[str, deque[float]] = {}

    def add(self, engine_id: str) -> None:
        self._times.setdefault(engine_id, deque()).append(time.monotonic())

    def counted_in(self, engine: EngineEntry) -> EngineEntry:
        """`engine` with its recent picks added to its waiting requests."""
        times = self._times.get(engine.engine_id)
        if not times:
            return engine
        horizon = time.monotonic() - self._window_s
        while times and times[0] < horizon:
            times.popleft()
        if not times:
            del self._times[engine.engine_id]
            return engine
        load = replace(engine.load, num_waiting=engine.load.num_waiting + len(times))
        return replace(engine, load=load)


@dataclass(slots=True)
class PendingBindings:
    """The binding writes a request's last pick left for later (`Router.pick`'s
    `pending`); a later pick of the same request (its stream moved) replaces them."""

    calls: list[ScriptCall] = field(default_factory=list)


class Router:
    """Picks an engine per request; safe to share by all requests of a gateway."""

    def __init__(self, registry: LiveEngines, sessions: EngineBindings,
                 prefixes: EngineBindings, policy: LoadPolicy, *, block_size: int = 16,
                 max_hint_blocks: int = 4, model: str | None = None,
                 recent_window_s: float = 2 * DEFAULT_INTERVAL_S):
        self._registry = registry
        self._sessions = sessions
        self._prefixes = prefixes
        self._policy = policy
        self._block_size = block_size
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
            block_size=settings.prefix_block_size, max_hint_blocks=settings.prefix_hint_blocks,
            model=model, recent_window_s=DEFAULT_INTERVAL_S + settings.engine_list_max_age_s,
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
        hashes = prefix_block_hashes(token_ids, self._block_size, self._max_hint_blocks,
                                     cache_salt, lora or "")
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
