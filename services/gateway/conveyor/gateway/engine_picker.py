"""Which engine replica takes a request (the routing seam).

For now: the configured engines, asked for their load (Engine.Stats), the least
loaded reachable one wins. Session affinity and prefix-cache hints come later
and slot in here.
"""

from __future__ import annotations

import asyncio
import logging

from conveyor.gateway.engine_client import EngineClient
from conveyor.gateway.engine_records import EngineLoad
from conveyor.gateway.upstream_error import UpstreamError

log = logging.getLogger("conveyor.gateway.engine_picker")


class NoEngineAvailable(Exception):
    """No configured engine answered; the caller should retry later."""


class EnginePicker:
    """Picks the least loaded engine among those that answer Stats in time."""

    def __init__(self, engines: list[EngineClient], stats_timeout_s: float):
        if not engines:
            raise ValueError("no engine addresses; set CONVEYOR_GATEWAY_ENGINE_ADDRESSES")
        self.engines = engines
        self._stats_timeout_s = stats_timeout_s

    async def pick(self) -> EngineClient:
        """The least loaded reachable engine; raises NoEngineAvailable when none answers."""
        loads = await self.loads()
        reachable = [(load, engine) for engine, load in zip(self.engines, loads, strict=True)
                     if load is not None]
        if not reachable:
            raise NoEngineAvailable(f"none of {len(self.engines)} engine(s) is reachable")
        return min(reachable, key=lambda pair: _load_key(pair[0]))[1]

    async def loads(self) -> list[EngineLoad | None]:
        """Each engine's load, None for one that did not answer."""
        return list(await asyncio.gather(*(self._load_of(e) for e in self.engines)))

    async def any_reachable(self) -> bool:
        return any(load is not None for load in await self.loads())

    async def _load_of(self, engine: EngineClient) -> EngineLoad | None:
        try:
            return await engine.stats(timeout_s=self._stats_timeout_s)
        except UpstreamError as error:
            log.warning("engine %s unreachable: %s", engine.address, error)
            return None


def _load_key(load: EngineLoad) -> tuple[int, float]:
    return (load.num_requests, load.kv_usage)
