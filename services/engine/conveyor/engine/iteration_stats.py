"""Per-step latency and token counts, handed from the engine core to the metrics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class IterationStats:
    """What happened in one step, in seconds and tokens (plain data; metrics.py observes it)."""

    num_prompt_tokens: int = 0
    """Prompt tokens of requests that finished their prefill this step."""
    num_generation_tokens: int = 0
    time_to_first_token: list[float] = field(default_factory=list)
    inter_token_latency: list[float] = field(default_factory=list)
    queue_time: list[float] = field(default_factory=list)
    """Arrival to first scheduled, for requests scheduled for the first time."""
    e2e_latency: list[float] = field(default_factory=list)
