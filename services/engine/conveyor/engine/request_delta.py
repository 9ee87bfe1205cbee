"""What one engine step produced for one request: its new tokens, and the end if it ended."""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.engine.core.request import FinishReason
from conveyor.engine.core.scheduler_output import PromptTokenLogprob, SampledToken
from conveyor.engine.request_timing import RequestTiming


@dataclass(slots=True)
class RequestDelta:
    """The tokens a request gained in one step (possibly none, when it just finished).

    `request_id` is the caller's id; `index` tells the n > 1 samples apart (0 otherwise).
    `error` is set when the engine failed this request: it is then finished with ABORT.
    `invalid_request` says the request itself was at fault (its structured-output
    constraint does not compile, or not in time): INVALID_ARGUMENT, not INTERNAL.
    """

    request_id: str
    index: int = 0
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[SampledToken] | None = None
    """One entry per new token when the request asked for logprobs."""
    prompt_logprobs: list[PromptTokenLogprob] | None = None
    """On the delta with a request's first token, when it asked for prompt logprobs: one
    entry per prompt position 1 .. num_prompt_tokens - 1."""
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    """The stop token id (EOS or one of stop_token_ids) that ended the request, if any."""
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_draft_tokens: int = 0
    """Drafts speculative decoding verified for this sample so far."""
    num_accepted_draft_tokens: int = 0
    """Of those, the ones the sampler accepted (including any dropped after a token that
    finished the sample)."""
    error: str | None = None
    invalid_request: bool = False
    timing: RequestTiming | None = None
    """On a sample's final delta: when it arrived, was scheduled, prefilled, preempted,
    decoded and finished (what its trace spans are made of)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
