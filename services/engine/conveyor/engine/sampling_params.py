"""Sampling controls of one request, validated once when the request arrives."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_TOP_LOGPROBS = 20


class InvalidSamplingParams(ValueError):
    """A sampling value is out of range; the message names the field."""


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request (vLLM's names and OpenAI's defaults).

    temperature 0 means greedy. top_k <= 0 means no top-k cut. n > 1 runs n
    independent samples of the same prompt (they share its cached blocks).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        self.validate()

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
        _check(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= -1, "top_k", f"must be -1, 0 (all) or positive, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
               f"must be in [-2, 2], got {self.presence_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
               f"must be in [-2, 2], got {self.frequency_penalty}")
        _check(self.repetition_penalty > 0.0, "repetition_penalty",
               f"must be > 0, got {self.repetition_penalty}")
        _check(self.max_tokens >= 1, "max_tokens", f"must be at least 1, got {self.max_tokens}")
        _check(0 <= self.min_tokens <= self.max_tokens, "min_tokens",
               f"must be in [0, max_tokens], got {self.min_tokens}")
        _check(0 <= self.top_logprobs <= MAX_TOP_LOGPROBS, "top_logprobs",
               f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        for token_id, bias in self.logit_bias.items():
            _check(-100.0 <= bias <= 100.0, "logit_bias",
                   f"bias for token {token_id} must be in [-100, 100], got {bias}")


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise InvalidSamplingParams(f"{name} {message}")
