"""What one step produced for one request: the engine loop streams it to the client."""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.engine.core.request import FinishReason
from conveyor.engine.core.scheduler_output import SampledToken


@dataclass(slots=True)
class RequestUpdate:
    """New tokens (with logprobs when asked for) and, on the last one, the finish reason.
    One token a step, or with drafts the accepted ones and the token sampled after them.

    Usage counts are the request's totals after this step; `num_cached_tokens`
    is the prompt tokens served from the prefix cache (usage.cached_tokens).
    """

    request_id: str
    new_tokens: list[SampledToken] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_draft_tokens: int = 0
    """Drafts this step verified for it (speculative decoding)."""
    num_accepted_tokens: int = 0
    """Of those, the ones the sampler accepted (some may be dropped after a finish)."""

    @property
    def new_token_ids(self) -> list[int]:
        return [token.token_id for token in self.new_tokens]

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None
