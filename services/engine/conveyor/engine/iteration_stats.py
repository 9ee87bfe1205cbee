"""Per-step latency and token counts, handed from the engine core to the metrics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class FinishedRequestStats:
    """One request (sample) that finished this step: how it ended and where its time went
    (seconds; prefill is first scheduled to first token, decode first token to finish)."""

    finish_reason: str
    """"stop", "length" or "abort" (vLLM's finished_reason label values)."""
    e2e_latency: float
    queue_time: float
    prefill_time: float
    decode_time: float
    num_prompt_tokens: int
    num_generation_tokens: int
    max_tokens: int

    @property
    def inference_time(self) -> float:
        return self.prefill_time + self.decode_time


@dataclass(slots=True)
class IterationStats:
    """What happened in one step, in seconds and tokens (plain data; metrics.py observes it)."""

    num_scheduled_tokens: int = 0
    """Tokens the step computed (0 when the scheduler found nothing to run)."""
    num_prompt_tokens: int = 0
    """Prompt tokens of requests that finished their prefill this step."""
    num_generation_tokens: int = 0
    time_to_first_token: list[float] = field(default_factory=list)
    inter_token_latency: list[float] = field(default_factory=list)
    queue_time: list[float] = field(default_factory=list)
    """Arrival to first scheduled, for requests scheduled for the first time."""
    finished: list[FinishedRequestStats] = field(default_factory=list)
