"""What one engine step returns to its driver (the async loop or the offline LLM)."""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.engine.iteration_stats import IterationStats
from conveyor.engine.request_delta import RequestDelta


@dataclass(slots=True)
class StepResult:
    deltas: list[RequestDelta] = field(default_factory=list)
    iteration: IterationStats = field(default_factory=IterationStats)

    @property
    def num_scheduled_tokens(self) -> int:
        """0 when the scheduler found nothing it could run this step."""
        return self.iteration.num_scheduled_tokens
