"""What one engine step produced for one request: its new tokens, and the end if it ended.

The engine's one step output (vLLM v1's EngineCoreOutput): the scheduler makes it, and
the engine core, the async engine, the servicer and the offline LLM pass it on."""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.engine.core.request import FinishReason, Request
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


def delta_of(request: Request, new_tokens: list[SampledToken], error: str | None = None,
             invalid_request: bool = False) -> RequestDelta:
    """`request`'s delta for this step: `new_tokens` (their logprobs when it asked), its
    prompt logprobs with its first token, its finish and usage so far."""
    reason = request.finish_reason
    prompt_logprobs = None
    if request.pending_prompt_logprobs is not None and (new_tokens or reason is not None):
        prompt_logprobs, request.pending_prompt_logprobs = request.pending_prompt_logprobs, None
    stop_token_id = None
    if reason is FinishReason.STOP and request.output_token_ids:
        stop_token_id = request.output_token_ids[-1]
    return RequestDelta(
        request_id=request.caller_id,
        index=request.sample_index,
        new_token_ids=[token.token_id for token in new_tokens],
        new_logprobs=list(new_tokens) if request.sampling_params.logprobs else None,
        prompt_logprobs=prompt_logprobs,
        finish_reason=reason,
        stop_token_id=stop_token_id,
        num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=request.num_output_tokens,
        num_cached_tokens=request.num_cached_tokens or 0,
        num_draft_tokens=request.num_draft_tokens,
        num_accepted_draft_tokens=request.num_accepted_tokens,
        error=error,
        invalid_request=invalid_request,
    )
