"""Picking an engine: least loaded among those that answer, loads shared briefly."""

from __future__ import annotations

import pytest

from conveyor.common.engine_registry import EngineLoad
from conveyor.gateway.routing.router import EnginePicker, NoEngineAvailable
from conveyor.gateway.wire import UpstreamError


class StubEngine:
    def __init__(self, address: str, num_running: int | None):
        self.address = address
        self.num_running = num_running
        self.num_stats_calls = 0

    async def stats(self, timeout_s: float | None = None) -> EngineLoad:
        self.num_stats_calls += 1
        if self.num_running is None:
            raise UpstreamError("engine", "UNAVAILABLE", "connection refused")
        return EngineLoad(self.num_running, 0, 0.1, 10, 10)


async def test_least_loaded_reachable_engine_wins():
    down, busy, idle = StubEngine("a", None), StubEngine("b", 5), StubEngine("c", 1)
    picker = EnginePicker([down, busy, idle], stats_timeout_s=1, max_age_s=0)
    assert await picker.pick() is idle


async def test_no_reachable_engine_raises():
    picker = EnginePicker([StubEngine("a", None)], stats_timeout_s=1)
    with pytest.raises(NoEngineAvailable):
        await picker.pick()


async def test_a_burst_shares_one_stats_round_and_spreads_over_engines():
    first, second = StubEngine("a", 0), StubEngine("b", 0)
    picker = EnginePicker([first, second], stats_timeout_s=1, max_age_s=60)
    picked = [await picker.pick() for _ in range(4)]
    assert [e.address for e in picked] == ["a", "b", "a", "b"]
    assert first.num_stats_calls == second.num_stats_calls == 1
