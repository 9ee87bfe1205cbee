"""The live engines of a gateway: those registered in Redis (`--scale engine=N`; their
load comes with their heartbeat, at most one interval old) are the truth; while none
has registered, the configured addresses stand in (`StaticEngines`: live while they
answer Stats, under the id, block size and max_model_len their Info reports, so
session bindings, prefix hints and length checks read the same either way). The list
is read once per heartbeat interval for all requests of a gateway, and an engine a
request could not reach is left out for one registry TTL (`EngineDirectory`)."""

from __future__ import annotations

import asyncio
import logging
import time

from redis.exceptions import RedisError

from conveyor.common.engine_registry import (
    DEFAULT_INTERVAL_S,
    DEFAULT_TTL_S,
    EngineEntry,
    EngineLoad,
    EngineRegistry,
)
from conveyor.common.left_out import LeftOut
from conveyor.gateway.clients.engine import EngineClient, EngineFacts
from conveyor.gateway.clients.upstream import UpstreamError

log = logging.getLogger("conveyor.gateway.routing")


class NoEngineAvailable(Exception):
    """No live engine serves the request (`Router.pick`); the caller should retry later."""


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
                        fact.max_loras, fact.block_size, fact.max_model_len)
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
