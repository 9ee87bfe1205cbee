"""Checks of a request against the engine's limits, shared by the gRPC servicer and the LLM."""

from __future__ import annotations

from conveyor.common.errors import CONTEXT_LENGTH_EXCEEDED, INVALID_REQUEST
from conveyor.common.sampling_fields import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, MAX_NUM_SAMPLES
from conveyor.engine.engine_info import EngineInfo
from conveyor.engine.engine_request import EngineRequest


class InvalidRequestError(ValueError):
    """A request the engine refuses; `reason` is one of conveyor.common.errors' reasons."""

    def __init__(self, message: str, reason: str = INVALID_REQUEST):
        super().__init__(message)
        self.reason = reason


def validate_request(request: EngineRequest, info: EngineInfo) -> None:
    """Raise InvalidRequestError saying what is wrong with `request`, if anything.

    Sampling ranges (and finite floats) are checked when SamplingParams is built
    (InvalidSamplingParams); here, n against MAX_NUM_SAMPLES and that every token id is
    inside the vocabulary.
    """
    prompt = request.prompt_token_ids
    if not prompt:
        raise InvalidRequestError("prompt_token_ids must not be empty")
    bad = next((t for t in prompt if not 0 <= t < info.vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(
            f"prompt token id {bad} is out of range for the vocabulary of {info.vocab_size}")
    total = len(prompt) + request.sampling_params.max_tokens
    if total > info.max_model_len:
        raise InvalidRequestError(
            f"prompt of {len(prompt)} tokens + max_tokens {request.sampling_params.max_tokens} "
            f"= {total} exceeds max_model_len {info.max_model_len}",
            CONTEXT_LENGTH_EXCEEDED,
        )
    bad = next((t for t in request.sampling_params.logit_bias if not 0 <= t < info.vocab_size),
               None)
    if bad is not None:
        raise InvalidRequestError(f"logit_bias token id {bad} is out of range for the "
                                  f"vocabulary of {info.vocab_size}")
    _check_sampling(request, info)
    _check_resumed_output(request, info)


def _check_resumed_output(request: EngineRequest, info: EngineInfo) -> None:
    """Output produced elsewhere: in the vocabulary, short of max_tokens, one sample."""
    produced = request.output_token_ids
    if not produced:
        return
    bad = next((t for t in produced if not 0 <= t < info.vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"resume_output_token_ids token id {bad} is out of range for "
                                  f"the vocabulary of {info.vocab_size}")
    params = request.sampling_params
    if len(produced) >= params.max_tokens:
        raise InvalidRequestError(f"{len(produced)} resume_output_token_ids already reach "
                                  f"max_tokens {params.max_tokens}: nothing is left to generate")
    if params.n != 1:
        raise InvalidRequestError("resume_output_token_ids needs n = 1")

def _check_sampling(request: EngineRequest, info: EngineInfo) -> None:
    params = request.sampling_params
    if params.n > MAX_NUM_SAMPLES:
        raise InvalidRequestError(f"n must be at most {MAX_NUM_SAMPLES}, got {params.n}")
    named_ids = [("stop_token_ids", params.stop_token_ids),
                 ("allowed_token_ids", params.allowed_token_ids),
                 *(("bad_words", sequence) for sequence in params.bad_words)]
    for name, ids in named_ids:
        bad = next((t for t in ids if not 0 <= t < info.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"{name} token id {bad} is out of range for the "
                                      f"vocabulary of {info.vocab_size}")
    _check_allowed_tokens(params, info)
    _check_bad_words(params)


def _check_bad_words(params) -> None:
    """Bounded (each is matched at every step), and not with what could leave a step
    nothing to sample (an allowed list or a grammar that allows only banned tokens)."""
    if not params.bad_words:
        return
    if len(params.bad_words) > 2 * MAX_BAD_WORDS or any(
            not 0 < len(s) <= MAX_BAD_WORD_TOKENS for s in params.bad_words):
        raise InvalidRequestError(f"bad_words must be at most {2 * MAX_BAD_WORDS} sequences of "
                                  f"1 to {MAX_BAD_WORD_TOKENS} tokens")
    if params.allowed_token_ids or params.structured_outputs is not None:
        raise InvalidRequestError("bad_words cannot be combined with allowed_token_ids or a "
                                  "structured output (response_format, structured_outputs, "
                                  "guided_* or a tool call that must be made)")


def _check_allowed_tokens(params, info: EngineInfo) -> None:
    """Masks that could leave a step nothing to sample (a row of -inf breaks the draw):
    allowed_token_ids under a structured output (whose grammar may allow none of them at
    some step); and every token a first step may take banned (outside allowed_token_ids, a
    one-token bad word, or a stop id or EOS while min_tokens holds the request open)."""
    if params.allowed_token_ids and params.structured_outputs is not None:
        raise InvalidRequestError("allowed_token_ids cannot be combined with a structured "
                                  "output (response_format, structured_outputs, guided_* or "
                                  "a tool call that must be made)")
    banned = {s[0] for s in params.bad_words if len(s) == 1}
    if params.min_tokens:
        banned |= set(params.stop_token_ids) | (set() if params.ignore_eos
                                                 else set(info.eos_token_ids))
    left = (len(set(params.allowed_token_ids) - banned) if params.allowed_token_ids
            else info.vocab_size - len(banned))
    if left < 1:
        raise InvalidRequestError("allowed_token_ids, bad_words, stop_token_ids and EOS under "
                                  f"min_tokens {params.min_tokens} leave no token to sample")
