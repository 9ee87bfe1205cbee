"""Sampling controls of one request, validated once when the request arrives."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from conveyor.common.sampling_fields import MAX_TOP_LOGPROBS, SamplingKnobs, knob_problem

if TYPE_CHECKING:
    from conveyor.engine.structured.structured_outputs_params import StructuredOutputsParams

class InvalidSamplingParams(ValueError):
    """A sampling value is out of range; the message names the field."""


@dataclass(slots=True)
class SamplingParams(SamplingKnobs):
    """How to sample one request (vLLM's names and OpenAI's defaults).

    The optional knobs (temperature, top_p, top_k, min_p, seed and the penalties) and
    their ranges are inherited from the shared table (conveyor.common.sampling_fields);
    the fields here are the ones every request carries. temperature 0 means greedy;
    top_k <= 0 means no top-k cut. n > 1 runs n samples of the same prompt, which
    share its cached blocks (EngineCore). `structured_outputs` constrains the output
    (each sample keeps its own place in the grammar); the sampler masks what the
    constraint does not allow before anything else, logprobs included.
    """

    n: int = 1
    logit_bias: dict[int, float] = field(default_factory=dict)
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    allowed_token_ids: list[int] = field(default_factory=list)
    """vLLM's: sample only among these (empty: any token); kept sorted, each id once."""
    allowed_ids: Any = field(default=None, init=False, repr=False, compare=False)
    """allowed_token_ids as a tensor, made once by the sampler (which masks with it every
    step); None until then. This module stays torch-free: the scheduler imports it."""
    bad_words: list[list[int]] = field(default_factory=list)
    """vLLM's bad_words as token sequences: a sequence's last token is never sampled right
    after its other tokens (a one-token sequence: never)."""
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: int | None = None
    """Logprobs of the prompt's tokens with this many alternatives each (None: none)."""
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self.validate()
        if self.allowed_token_ids:
            self.allowed_token_ids = sorted(set(self.allowed_token_ids))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def validate(self) -> None:
        """Raise InvalidSamplingParams naming the first field out of range."""
        _check(self.n >= 1, "n", f"must be at least 1, got {self.n}")
        problem = knob_problem(self)
        if problem is not None:
            raise InvalidSamplingParams(problem)
        _check(self.max_tokens >= 1, "max_tokens", f"must be at least 1, got {self.max_tokens}")
        _check(0 <= self.min_tokens <= self.max_tokens, "min_tokens",
               f"must be in [0, max_tokens], got {self.min_tokens}")
        _check(0 <= self.top_logprobs <= MAX_TOP_LOGPROBS, "top_logprobs",
               f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        _check(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS,
               "prompt_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got "
               f"{self.prompt_logprobs}")
        for token_id, bias in self.logit_bias.items():
            _check(-100.0 <= bias <= 100.0, "logit_bias",
                   f"bias for token {token_id} must be in [-100, 100], got {bias}")


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise InvalidSamplingParams(f"{name} {message}")
