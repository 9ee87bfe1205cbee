"""What a client may send, checked on arrival, and what it becomes for the engine and detok.

Bodies: a request body over the gateway's limit is refused with 413 before it is read
whole (`BodySizeLimitMiddleware`). OpenAI request bodies (and vLLM's extensions) are
validated once: unknown fields are ignored, as OpenAI does; ranges follow OpenAI's API
reference; types are strict, as OpenAI's are (`"stream": "yes"` or `"max_tokens": "5"`
is a 400, not coerced; an integer is still a valid float); every integer is bounded by
what the protobuf field it travels in holds (uint32 / int32 / int64), so the bounds
show in /openapi.json; numbers must be finite; a string holding a lone surrogate (JSON
may escape one, UTF-8 cannot carry it) is refused.

Mapping: from a validated body to the engine's sampling options and detok's options
(`sampling_options`, `detok_options`, `max_tokens_for`, `check_limits`).
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator
from pydantic_core import PydanticCustomError
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from conveyor.common.sampling_fields import INT32_MAX, KNOBS, Knob
from conveyor.gateway.errors import APIError, bad_request, context_length_exceeded
from conveyor.gateway.text_services import ServedModel
from conveyor.gateway.wire import (
    ChatTurn,
    DetokOptions,
    PromptTokens,
    RenderInput,
    SamplingOptions,
    ToolCallParsing,
)

# -- body limit --------------------------------------------------------------------------

class BodySizeLimitMiddleware:
    """Pure ASGI middleware: 413 for HTTP request bodies over `max_body_bytes`."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, exempt_paths: tuple[str, ...] = ()):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.exempt_paths = exempt_paths
        """Paths whose routes limit their bodies themselves (file uploads)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.exempt_paths:
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await self._refuse(scope, receive, send)
        elif declared is not None:  # the HTTP server stops a body at its Content-Length
            await self.app(scope, receive, send)
        else:
            await self._buffered(scope, receive, send)

    async def _buffered(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Read a chunked body up to the limit, then hand it on in one message."""
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                await self._refuse(scope, receive, send)
                return
            more = message.get("more_body", False)
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(413, f"the request body is larger than this gateway's limit of "
                         f"{self.max_body_bytes} bytes", param=None, code="request_too_large")
        await JSONResponse(error.body(), status_code=413,
                           headers={"Connection": "close"})(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length" and value.isdigit():
            return int(value)
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives `body` first, then whatever the client sends next
    (a disconnect, which the request path races against)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed


# -- unicode text ------------------------------------------------------------------------

_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate_path(value: Any) -> str | None:
    """The dotted path (`messages.0.content`) of a string, or dict key, holding a
    lone surrogate; None when there is none. Iterative, so deep nesting cannot overflow."""
    pending: list[tuple[str, Any]] = [("", value)]
    while pending:
        path, item = pending.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return path
        elif isinstance(item, dict):
            for key, child in item.items():
                if isinstance(key, str) and _SURROGATE.search(key):
                    return _join(path, key.encode("utf-8", "backslashreplace").decode())
                child_path = _join(path, str(key))
                pending.append((child_path, child))
        elif isinstance(item, list):
            pending.extend((_join(path, str(i)), child) for i, child in enumerate(item))
    return None


def _join(path: str, part: str) -> str:
    return f"{path}.{part}" if path else part


# -- api models --------------------------------------------------------------------------

MAX_TOP_LOGPROBS = 20
UINT32_MAX = 2**32 - 1
INT32_MIN = -(2**31)
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


# -- structured outputs and tools (mapped by output_constraints.py) -------------------------

class JsonSchemaSpec(_Body):
    """response_format.json_schema: the schema the output must match."""

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    """OpenAI's flag; the schema is enforced by constrained decoding whether set or not."""


class TextFormat(_Body):
    type: Literal["text"]


class JsonObjectFormat(_Body):
    type: Literal["json_object"]


class JsonSchemaFormat(_Body):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormatField = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat,
                                Field(discriminator="type")]


class StructuredOutputsParams(_Body):
    """vLLM's `structured_outputs`: exactly one kind. Its other options (whitespace,
    structural tags, backends) are refused as unknown fields."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class FunctionDefinition(_Body):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Body):
    name: str = Field(min_length=1)


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


def _knob_field(knob: Knob) -> tuple[Any, Any]:
    """A body field for one row of the shared table: None when left out, bounded by the
    table's range (OpenAI's tighter api_le where it has one)."""
    spec = knob.spec
    high = spec.api_le if spec.api_le is not None else spec.le
    bounds = {name: value for name, value in (("ge", spec.ge), ("gt", spec.gt), ("le", high))
              if value is not None}
    return spec.type | None, Field(None, description=spec.doc, **bounds)


_Knobs = create_model("_Knobs", __base__=_RequestBody,
                      **{knob.name: _knob_field(knob) for knob in KNOBS})
"""The optional sampling parameters (temperature, top_p, seed, ...), from the shared table."""


class _SamplingFields(_Knobs):
    """Fields chat and completions share."""

    model: str | None = None
    max_tokens: TokenCount | None = None
    n: int = Field(1, ge=1, le=INT32_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=UINT32_MAX)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    user: str | None = None
    priority: int = Field(0, ge=INT32_MIN, le=INT32_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormatField | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None

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
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
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


# -- request mapping ---------------------------------------------------------------------

PROMPT_TAIL_TOKENS = 6
"""Prompt tokens detok gets so the first output token decodes with the right context."""

GenerationBody = ChatCompletionRequest | CompletionRequest


def check_limits(body: GenerationBody, model: ServedModel, max_n: int) -> None:
    """400 for values only the served model can judge (token ids, n)."""
    if body.n > max_n:
        raise bad_request(f"n must be at most {max_n}, got {body.n}", "n")
    for token_id in body.stop_token_ids or []:
        _check_token_id(token_id, model, "stop_token_ids")
    for key in body.logit_bias or {}:
        _check_token_id(int(key), model, "logit_bias")


def _check_token_id(token_id: int, model: ServedModel, param: str) -> None:
    if token_id >= model.vocab_size:
        raise bad_request(
            f"token id {token_id} is outside the vocabulary (size {model.vocab_size})", param
        )


def max_tokens_for(requested: int | None, prompt: PromptTokens, prompt_param: str) -> int:
    """What the engine may generate: the request's max_tokens, or by default what the
    context has left (max_model_len - prompt length, as vLLM does)."""
    room = prompt.max_model_len - prompt.num_tokens
    if requested is None and room < 1:
        raise context_length_exceeded(
            f"This model's maximum context length is {prompt.max_model_len} tokens. "
            f"However, your prompt has {prompt.num_tokens} tokens, leaving no room for output.",
            prompt_param,
        )
    return requested if requested is not None else room


def sampling_options(body: GenerationBody, max_tokens: int) -> SamplingOptions:
    """The engine's sampling controls for the body's n samples of one prompt (the engine
    gives sample i the seed + i)."""
    logprobs, top_logprobs = _logprob_request(body)
    knobs = {knob.name: getattr(body, knob.name) for knob in KNOBS}
    return SamplingOptions(
        max_tokens=max_tokens,
        knobs={name: value for name, value in knobs.items() if value is not None},
        logit_bias={int(k): v for k, v in (body.logit_bias or {}).items()},
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        min_tokens=body.min_tokens,
    )


def num_top_logprobs(body: GenerationBody) -> int | None:
    """How many alternatives each logprobs entry shows; None when logprobs are off."""
    logprobs, top_logprobs = _logprob_request(body)
    return top_logprobs if logprobs else None


def _logprob_request(body: GenerationBody) -> tuple[bool, int]:
    if isinstance(body, ChatCompletionRequest):
        return body.logprobs, body.top_logprobs or 0
    return body.logprobs is not None, body.logprobs or 0


def detok_options(body: GenerationBody, request_id: str, prompt: PromptTokens,
                  tool_calls: ToolCallParsing | None = None) -> DetokOptions:
    return DetokOptions(
        request_id=request_id,
        prompt_tail_token_ids=prompt.token_ids[-PROMPT_TAIL_TOKENS:],
        stop=body.stop_strings,
        include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens,
        spaces_between_special_tokens=body.spaces_between_special_tokens,
        tool_calls=tool_calls,
    )


def render_input(body: ChatCompletionRequest, max_tokens: int | None) -> RenderInput:
    return RenderInput(
        messages=chat_turns(body.messages),
        max_tokens=max_tokens or 0,
        add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
        continue_final_message=body.continue_final_message,
        chat_template=body.chat_template or "",
        tools_json=json.dumps([t.model_dump(exclude_none=True, by_alias=True)
                               for t in body.tools]) if body.tools else "",
        chat_template_kwargs_json=(
            json.dumps(body.chat_template_kwargs) if body.chat_template_kwargs else ""
        ),
    )


def chat_turns(messages: list[ChatMessage]) -> list[ChatTurn]:
    return [
        ChatTurn(
            role=m.role,
            content=m.content if isinstance(m.content, str) else "",
            parts=[p.text for p in m.content] if isinstance(m.content, list) else [],
            name=m.name or "",
            tool_call_id=m.tool_call_id or "",
            tool_calls_json=json.dumps(m.tool_calls) if m.tool_calls else "",
        )
        for m in messages
    ]
