"""The configured engine list (CONVEYOR_GATEWAY_ENGINE_ADDRESSES) seen as registry entries.

Used while no engine has registered in Redis: `make run` and single-engine setups.
An engine counts as live while it answers Stats (asked at most once per
`engine_stats_max_age_s`, shared by all requests); its id is the one its Info
reports, so a session binding reads the same whether engines register or not.
"""

from __future__ import annotations

import asyncio

from conveyor.common.engine_registry import EngineEntry, EngineLoad
from conveyor.gateway.engine_client import EngineClient
from conveyor.gateway.engine_picker import EnginePicker
from conveyor.gateway.engine_records import EngineFacts
from conveyor.gateway.upstream_error import UpstreamError


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
            EngineEntry(fact.engine_id or engine.address, engine.address, fact.model,
                        EngineLoad(load.num_running, load.num_waiting, load.kv_usage))
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
