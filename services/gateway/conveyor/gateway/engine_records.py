"""What the gateway sends to and reads from an engine, as plain data (no protobuf)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


@dataclass(slots=True)
class SamplingOptions:
    """How the engine samples one request; None takes the engine's (OpenAI's) default."""

    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    min_tokens: int = 0


@dataclass(slots=True)
class GenerateJob:
    """One Generate call: a prompt and how to continue it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    priority: int = 0
    cache_salt: str = ""
    resume_output_token_ids: list[int] = field(default_factory=list)
    """Output an earlier engine produced (a moved stream); the engine continues after it."""


class FinishReason(Enum):
    """Why the engine stopped a request."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(slots=True)
class PositionLogprobs:
    """The sampled token's logprob and the best alternatives (token id, logprob)."""

    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class TokenUsage:
    """Token counts of one request."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass(slots=True)
class EngineChunk:
    """Tokens the engine produced since its previous chunk."""

    token_ids: list[int]
    logprobs: list[PositionLogprobs]
    finish_reason: FinishReason | None
    usage: TokenUsage
    stop_token_id: int | None = None


@dataclass(slots=True)
class EngineFacts:
    """Static facts about an engine (Engine.Info)."""

    model: str
    max_model_len: int
    engine_id: str
