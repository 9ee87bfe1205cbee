"""Which engines may take requests now: the Redis registry, else the static list.

Engines that registered in Redis (compose, `--scale engine=N`) are the truth;
while none has, the configured addresses stand in (StaticEngines). An engine a
request just failed to reach is left out for one registry TTL, so the next
request (and its session) moves on instead of waiting for the engine's entry to
expire.
"""

from __future__ import annotations

import asyncio

from conveyor.common.engine_registry import DEFAULT_TTL_S, EngineEntry, EngineRegistry
from conveyor.gateway.static_engines import StaticEngines


class EngineDirectory:
    """Live engines for the router (see routing.router.LiveEngines)."""

    def __init__(self, registry: EngineRegistry, static: StaticEngines | None,
                 unreachable_for_s: float = DEFAULT_TTL_S):
        self._registry = registry
        self._static = static
        self._unreachable_for_s = unreachable_for_s
        self._unreachable_until: dict[str, float] = {}

    async def list_live(self, model: str | None = None) -> list[EngineEntry]:
        """Registered engines, or the static ones when none registered; minus those
        marked unreachable."""
        entries = await self._registry.list_live(model)
        if not entries and self._static is not None:
            entries = await self._static.list_live(model)
        return [e for e in entries if not self._is_unreachable(e.engine_id)]

    def mark_unreachable(self, engine_id: str) -> None:
        """A request could not reach this engine: route around it for a while."""
        now = asyncio.get_running_loop().time()
        self._unreachable_until[engine_id] = now + self._unreachable_for_s

    def _is_unreachable(self, engine_id: str) -> bool:
        until = self._unreachable_until.get(engine_id)
        if until is None:
            return False
        if asyncio.get_running_loop().time() < until:
            return True
        del self._unreachable_until[engine_id]
        return False
