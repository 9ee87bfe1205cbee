"""When a request is done after a new token: EOS, a stop token, max_tokens or max_model_len."""

from __future__ import annotations

from collections.abc import Container

from conveyor.engine.core.request import FinishReason, Request


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
