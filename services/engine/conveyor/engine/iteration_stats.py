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
    num_drafts: int = 0
    """Requests verified with drafts this step (speculative decoding)."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    """[j]: drafts accepted at position j (0: the first draft) this step."""

    def record_drafts(self, num_drafts: int, num_accepted: int) -> None:
        """One request's verification: `num_accepted` of its `num_drafts` drafts, the first
        ones, were accepted."""
        if not num_drafts:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        missing = num_accepted - len(self.accepted_per_position)
        self.accepted_per_position.extend([0] * max(0, missing))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1
