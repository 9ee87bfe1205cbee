"""OpenAI request bodies (and vLLM's extensions), validated once on arrival.

Unknown fields are ignored, as OpenAI does. Ranges follow OpenAI's API reference. Types
are strict, as OpenAI's are: `"stream": "yes"` or `"max_tokens": "5"` is a 400, not
coerced (an integer is still a valid float). Every integer is bounded by what the
protobuf field it travels in holds (uint32 / int32 / int64), so the bounds show in
/openapi.json; numbers must be finite; a string holding a lone surrogate is refused.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from conveyor.gateway.unicode_text import lone_surrogate_path

MAX_TOP_LOGPROBS = 20
UINT32_MAX = 2**32 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38
INVALID_UNICODE = "invalid_unicode"
"""Error type of a lone surrogate; its context's `param` names the field."""

TokenId = Annotated[int, Field(ge=0, le=UINT32_MAX)]
TokenCount = Annotated[int, Field(ge=1, le=UINT32_MAX)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class _RequestBody(_Body):
    """A whole request body: strings are checked for lone surrogates once, at the top."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        path = lone_surrogate_path(data)
        if path is not None:
            raise PydanticCustomError(
                INVALID_UNICODE, "{param}: the string holds a lone surrogate (invalid Unicode)",
                {"param": path})
        return data


class StreamOptions(_Body):
    include_usage: bool = False


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class _SamplingFields(_RequestBody):
    """Fields chat and completions share."""

    model: str | None = None
    max_tokens: TokenCount | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    n: int = Field(1, ge=1, le=INT32_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=FLOAT32_MAX)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=UINT32_MAX)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    user: str | None = None
    priority: int = Field(0, ge=INT32_MIN, le=INT32_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or {}:
            digits = key.strip()
            if not (digits.isascii() and digits.isdigit()) or int(digits) > UINT32_MAX:
                raise ValueError(f"keys must be token ids (0 to {UINT32_MAX}), got {key!r}")
        return bias

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return [s for s in stops if s]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: TokenCount | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


Prompt = str | list[str] | list[TokenId] | list[list[TokenId]]


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    max_tokens: TokenCount | None = 16
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    add_special_tokens: bool = True

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt: Prompt) -> Prompt:
        if prompt in ("", []) or (isinstance(prompt, list) and any(p in ("", []) for p in prompt)):
            raise ValueError("prompt must not be empty")
        return prompt

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the batch: a text or a list of token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]
        return list(self.prompt)


class TokenizeRequest(_RequestBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _prompt_or_messages(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(_RequestBody):
    model: str | None = None
    tokens: list[TokenId]
