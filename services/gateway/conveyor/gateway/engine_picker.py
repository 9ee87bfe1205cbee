"""The loads of the configured engines (CONVEYOR_GATEWAY_ENGINE_ADDRESSES), by Engine.Stats.

The gateway routes with routing.Router; while no engine has registered in Redis,
StaticEngines turns these loads into registry entries. Loads are shared by
concurrent requests for a short while (one Stats round per `max_age_s`). `pick`
(the least loaded reachable engine, each pick counting against it until the
next round so a burst spreads) serves callers without a router.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

from conveyor.gateway.engine_client import EngineClient
from conveyor.gateway.engine_records import EngineLoad
from conveyor.gateway.upstream_error import UpstreamError

log = logging.getLogger("conveyor.gateway.engine_picker")


class NoEngineAvailable(Exception):
    """No configured engine answered; the caller should retry later."""


class EnginePicker:
    """Picks the least loaded engine among those that answered Stats."""

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

    async def pick(self) -> EngineClient:
        """The least loaded reachable engine; raises NoEngineAvailable when none answers."""
        loads = await self.loads()
        reachable = [i for i, load in enumerate(loads) if load is not None]
        if not reachable:
            raise NoEngineAvailable(f"none of {len(self.engines)} engine(s) answered")
        best = min(reachable, key=lambda i: _load_key(loads[i]))
        loads[best] = replace(loads[best], num_waiting=loads[best].num_waiting + 1)
        return self.engines[best]

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

    async def any_reachable(self) -> bool:
        return any(load is not None for load in await self.loads())

    async def _ask_all(self) -> list[EngineLoad | None]:
        return list(await asyncio.gather(*(self._load_of(e) for e in self.engines)))

    async def _load_of(self, engine: EngineClient) -> EngineLoad | None:
        try:
            return await engine.stats(timeout_s=self._stats_timeout_s)
        except UpstreamError as error:
            log.warning("engine %s did not answer Stats: %s", engine.address, error)
            return None


def _load_key(load: EngineLoad) -> tuple[int, float]:
    return (load.num_requests, load.kv_usage)
