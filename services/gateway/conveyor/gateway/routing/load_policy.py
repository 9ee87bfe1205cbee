"""When an engine counts as overloaded, and which engine is least loaded."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from conveyor.common.engine_registry import EngineEntry


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

    def is_overloaded(self, engine: EngineEntry) -> bool:
        return engine.load.num_waiting > self.max_waiting or \
            engine.load.kv_usage > self.max_kv_usage

    def least_loaded(self, engines: Iterable[EngineEntry]) -> EngineEntry:
        """The engine with the fewest requests (then least KV in use), preferring
        engines that are not overloaded; ties go to the smaller engine id."""
        return min(engines, key=lambda e: (self.is_overloaded(e), e.load.num_requests,
                                           e.load.kv_usage, e.engine_id))

    def is_much_busier(self, engine: EngineEntry, least: EngineEntry) -> bool:
        return engine.load.num_requests - least.load.num_requests > self.max_imbalance
