"""When things happened to one scheduler request: the raw material of its trace spans.

Written by the engine loop thread only, while the request is in the engine; handed
to the caller with the request's final delta, after which the loop never touches
it again. Times are `time.monotonic()` seconds; None until the event happened.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class PrefillChunk:
    """One step's share of a request's prompt (or, after a preemption, of its recompute)."""

    start_time: float
    first_position: int
    """Position of the chunk's first token in the sequence (tokens before it were cached
    or computed by earlier chunks)."""
    num_tokens: int
    end_time: float | None = None


@dataclass(slots=True)
class RequestTiming:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    prefill_chunks: list[PrefillChunk] = field(default_factory=list)
    preemption_times: list[float] = field(default_factory=list)

    @property
    def num_preemptions(self) -> int:
        return len(self.preemption_times)
