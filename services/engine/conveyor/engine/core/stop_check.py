"""A step's sampled tokens joining a request, and when it is done after one: EOS, a stop
token, max_tokens or max_model_len."""

from __future__ import annotations

from collections.abc import Container

from conveyor.engine.core.request import FinishReason, Request
from conveyor.engine.core.scheduler_output import SampledToken


def append_sampled(request: Request, sampled: list[SampledToken], num_drafts: int,
                   eos_token_ids: Container[int], max_model_len: int) -> list[SampledToken]:
    """Append a step's tokens up to the first that finishes `request` (those after it are
    dropped; its finish_reason is then set), and adapt how many drafts it is verified
    with next. Returns the tokens appended."""
    new_tokens: list[SampledToken] = []
    for token in sampled:
        request.output_token_ids.append(token.token_id)
        if request.grammar is not None:
            request.grammar.accept(token.token_id)
        new_tokens.append(token)
        request.finish_reason = check_finished(request, eos_token_ids, max_model_len)
        if request.finish_reason is not None:
            break
    if num_drafts:
        num_accepted = len(sampled) - 1
        request.num_draft_tokens += num_drafts
        request.num_accepted_tokens += num_accepted
        request.draft_limit = None if num_accepted == num_drafts else max(1, num_accepted + 1)
    return new_tokens


def check_finished(
    request: Request, eos_token_ids: Container[int], max_model_len: int
) -> FinishReason | None:
    """The reason `request` must stop now that its last output token is appended, or None.

    EOS (unless ignore_eos) and stop_token_ids count only once min_tokens are out;
    they win over the length limits, so an EOS that is also the max_tokens-th
    token reports "stop". A constrained request stops at EOS whatever ignore_eos and
    min_tokens say: its grammar allows EOS only where the output is a whole match, and
    nothing after it.
    """
    params = request.sampling_params
    num_output = len(request.output_token_ids)
    last = request.output_token_ids[-1]
    if request.grammar is not None and last in eos_token_ids:
        return FinishReason.STOP
    if num_output >= params.min_tokens:
        if not params.ignore_eos and last in eos_token_ids:
            return FinishReason.STOP
        if last in params.stop_token_ids:
            return FinishReason.STOP
    if num_output >= params.max_tokens or request.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None
