"""What a client may send, checked on arrival, and what it becomes for the engine and detok.

Bodies: a request body over the gateway's limit is refused with 413 before it is read
whole (`BodySizeLimitMiddleware`). OpenAI request bodies (and vLLM's extensions) are
validated once: a field in neither schema is a 400 naming it, as OpenAI answers; a field
of OpenAI's schema that this server cannot honour is a 400 naming it when it is set
(`unsupported`); what each field does is listed in docs/api.md. Ranges follow OpenAI's
API reference; types are strict, as OpenAI's are (`"stream": "yes"` or `"max_tokens": "5"`
is a 400, not coerced; an integer is still a valid float); every integer is bounded by
what the protobuf field it travels in holds (uint32 / int32 / int64), so the bounds
show in /openapi.json; numbers must be finite; a string holding a lone surrogate (JSON
may escape one, UTF-8 cannot carry it) is refused.

Mapping: from a validated body to the engine's sampling options and detok's options
(`sampling_options`, `detok_options`, `max_tokens_for`, `check_limits`) and to what its
response shows (`output_options`).
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
from conveyor.gateway.clients.detok import DetokOptions, ToolCallParsing
from conveyor.gateway.clients.engine import SamplingOptions
from conveyor.gateway.clients.tokenizer import ChatTurn, PromptTokens, RenderInput
from conveyor.gateway.errors import APIError, bad_request, context_length_exceeded
from conveyor.gateway.models import ServedModel
from conveyor.gateway.response_formats import OutputOptions

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


class BodyPart(BaseModel):
    """An object of a request body: unknown fields refused, types strict, numbers finite."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


UNSUPPORTED = "unsupported_parameter"
"""Error type of a field set to what this server cannot honour; its context's `param`
names the field and `message` says why."""
INVALID = "invalid_parameter"
"""Error type of a field whose value is wrong given the others (context as UNSUPPORTED's)."""


def refuse_set_fields(body: BaseModel, refused: dict[str, str]) -> None:
    """Raise `unsupported` for the first field of `refused` (name -> why) that is set."""
    for name, why in refused.items():
        if getattr(body, name) is not None:
            raise unsupported(name, why)


def invalid(param: str, message: str) -> PydanticCustomError:
    """The validation error of a field (`param`) that is wrong, saying why."""
    return PydanticCustomError(INVALID, "{message}", {"param": param, "message": message})


def unsupported(param: str, why: str, what: str | None = None) -> PydanticCustomError:
    """The validation error of a field this server refuses, saying why: `param` names it
    (`messages.audio`: the field `audio` of the message at the error's location), `what`
    is what the message calls it (default: `param`)."""
    return PydanticCustomError(UNSUPPORTED, "{message}", {
        "param": param, "message": f"{what or param} is not supported: {why}"})


class RequestBody(BodyPart):
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


class StreamOptions(BodyPart):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    """vLLM's: every chunk carries the usage so far (its choice's completion tokens)."""
    include_obfuscation: bool = False
    """OpenAI's: content chunks carry an `obfuscation` field of random characters that
    evens out their sizes (off unless asked for, where OpenAI's default is on)."""


# -- structured outputs and tools (mapped by output_constraints.py) -------------------------

class JsonSchemaSpec(BodyPart):
    """response_format.json_schema: the schema the output must match."""

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    """OpenAI's flag; the schema is enforced by constrained decoding whether set or not."""


class TextFormat(BodyPart):
    type: Literal["text"]


class JsonObjectFormat(BodyPart):
    type: Literal["json_object"]


class JsonSchemaFormat(BodyPart):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormatField = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat,
                                Field(discriminator="type")]


class StructuredOutputsParams(BodyPart):
    """vLLM's `structured_outputs`: exactly one kind. Its other options (whitespace,
    structural tags, backends) are refused as unknown fields."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class FunctionDefinition(BodyPart):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BodyPart):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BodyPart):
    name: str = Field(min_length=1)


class NamedToolChoice(BodyPart):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class TextPart(BodyPart):
    type: Literal["text"]
    text: str


class RefusalPart(BodyPart):
    """An assistant's earlier refusal, fed back: rendered as its text."""

    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[TextPart | RefusalPart, Field(discriminator="type")]


class ChatMessage(BodyPart):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    refusal: str | None = None
    """An assistant's earlier refusal (as the SDK returns it): its text when content is empty."""
    annotations: list[dict[str, Any]] | None = None
    """Citations of an earlier answer, fed back: no effect (the model reads the text)."""
    audio: Any = None
    function_call: Any = None

    @model_validator(mode="after")
    def _no_audio_or_functions(self):
        if self.audio is not None:
            raise unsupported("messages.audio", "this model reads and writes text only")
        if self.function_call is not None:
            raise unsupported("messages.function_call",
                              "the deprecated functions API; send tool_calls")
        return self

    @property
    def text_parts(self) -> list[str]:
        if not isinstance(self.content, list):
            return []
        return [p.text if isinstance(p, TextPart) else p.refusal for p in self.content]

    @property
    def text(self) -> str:
        """The content when it is a string, else the refusal's text (or "")."""
        if isinstance(self.content, str):
            return self.content
        if self.content is None:
            return self.refusal or ""
        return ""


def knob_field(knob: Knob) -> tuple[Any, Any]:
    """A body field for one row of the shared table: None when left out, bounded by the
    table's range (OpenAI's tighter api_le where it has one)."""
    spec = knob.spec
    high = spec.api_le if spec.api_le is not None else spec.le
    bounds = {name: value for name, value in (("ge", spec.ge), ("gt", spec.gt), ("le", high))
              if value is not None}
    return spec.type | None, Field(None, description=spec.doc, **bounds)


_Knobs = create_model("_Knobs", __base__=RequestBody,
                      **{knob.name: knob_field(knob) for knob in KNOBS})
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
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    """vLLM's: the logprob of each prompt token after the first, with this many alternatives."""
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
        if self.prompt_logprobs is not None and self.stream:
            raise unsupported("prompt_logprobs", "prompt logprobs are not available when "
                              "stream is true (as vLLM answers)")
        return self

    @property
    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return [s for s in stops if s]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def routing_key(self) -> str | None:
        """What keeps a conversation on one engine (after the X-Session-ID header)."""
        return self.user

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt position the engine computes (None: no prompt logprobs)."""
        return self.prompt_logprobs

    @property
    def is_flex(self) -> bool:
        """service_tier "flex": run in the lowest band of the tenant's tier."""
        return False

    @property
    def served_tier(self) -> str | None:
        """The service_tier a response names (None: none asked for)."""
        return None

    @property
    def timeline_fields(self) -> dict[str, str]:
        """What the request's timeline keeps of the body (metadata, safety_identifier)."""
        return {}


_MAX_METADATA_PAIRS = 16
ServiceTier = Literal["auto", "default", "flex", "scale", "priority", "fast"]
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
Verbosity = Literal["low", "medium", "high"]
Metadata = dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]]

_REFUSED_CHAT_FIELDS = {
    "audio": "this model writes text only",
    "functions": "the deprecated functions API; send tools",
    "function_call": "the deprecated functions API; send tool_choice",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "there is no web search here",
    "moderation": "no moderation model runs here",
    "prompt_cache_options": "the prefix cache is automatic: shared prompt prefixes are reused "
                            "while they stay in an engine's KV cache",
}
"""Fields of OpenAI's chat schema this server refuses whenever they are set (not null)."""


class OpenAIOptions(RequestBody):
    """The OpenAI fields chat completions and responses share beyond sampling: honoured
    (metadata, service_tier, prompt_cache_key, safety_identifier), without effect on a
    model that has no reasoning and no verbosity training (reasoning_effort is chat's,
    verbosity), or refused when set to what cannot be honoured (prompt_cache_retention
    "24h")."""

    metadata: Metadata | None = None
    """Kept on the request's timeline (GET /v1/requests/{id})."""
    service_tier: ServiceTier | None = None
    """"flex" runs in the lowest priority band of the tenant's tier; the others in the
    tier's own. The response says which ("default" or "flex")."""
    prompt_cache_key: str | None = None
    """Keeps requests that share it on the engine caching their prefix (the routing
    session key, after the X-Session-ID header)."""
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    """"in_memory" is what the engines do; "24h" is refused."""
    safety_identifier: str | None = Field(None, max_length=64)
    """Kept on the request's timeline."""

    @field_validator("metadata")
    @classmethod
    def _at_most_16_pairs(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        if metadata is not None and len(metadata) > _MAX_METADATA_PAIRS:
            raise ValueError(f"at most {_MAX_METADATA_PAIRS} key-value pairs, "
                             f"got {len(metadata)}")
        return metadata

    @model_validator(mode="after")
    def _no_extended_cache_retention(self):
        if self.prompt_cache_retention == "24h":
            raise unsupported("prompt_cache_retention", "prefixes stay cached while they fit "
                              "in an engine's KV cache (in_memory), never for a set time")
        return self

    @property
    def is_flex(self) -> bool:
        return self.service_tier == "flex"

    @property
    def served_tier(self) -> str | None:
        """The service_tier a response names: the one used, when one was asked for."""
        if self.service_tier is None:
            return None
        return "flex" if self.is_flex else "default"

    @property
    def routing_key(self) -> str | None:
        return self.prompt_cache_key or self.user

    @property
    def timeline_fields(self) -> dict[str, str]:
        fields = {"metadata": json.dumps(self.metadata)} if self.metadata else {}
        if self.safety_identifier:
            fields["safety_identifier"] = self.safety_identifier
        return fields


class ChatCompletionRequest(OpenAIOptions, _SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: TokenCount | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    store: bool | None = None
    """Chat completions are never stored here: true is refused."""
    reasoning_effort: ReasoningEffort | None = None
    """No effect: the served model does no reasoning."""
    verbosity: Verbosity | None = None
    """No effect: the served model was not trained to follow it."""
    modalities: list[Literal["text", "audio"]] | None = None
    """["text"] is what the model writes; "audio" is refused."""
    audio: Any = None
    functions: Any = None
    function_call: Any = None
    prediction: Any = None
    web_search_options: Any = None
    moderation: Any = None
    prompt_cache_options: Any = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @model_validator(mode="after")
    def _refused_fields(self):
        refuse_set_fields(self, _REFUSED_CHAT_FIELDS)
        if self.store:
            raise unsupported("store", "chat completions are not stored; send store false "
                              "or leave it out (the Responses API stores responses)")
        if self.modalities is not None and "audio" in self.modalities:
            raise unsupported("modalities", "this model writes text only")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


Prompt = str | list[str] | list[TokenId] | list[list[TokenId]]


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    max_tokens: TokenCount | None = 16
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    """The prompt before each choice's text (with its tokens' logprobs when logprobs is
    set: the first has none)."""
    best_of: int | None = Field(None, ge=1, le=INT32_MAX)
    """Only best_of = n (return every candidate) is served."""
    suffix: str | None = None
    add_special_tokens: bool = True

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt: Prompt) -> Prompt:
        if prompt in ("", []) or (isinstance(prompt, list) and any(p in ("", []) for p in prompt)):
            raise ValueError("prompt must not be empty")
        return prompt

    @model_validator(mode="after")
    def _refused_fields(self):
        if self.suffix is not None:
            raise unsupported("suffix", "this model has no fill-in-the-middle training")
        if self.best_of is not None and self.best_of != self.n:
            raise unsupported("best_of", "only best_of equal to n (every candidate "
                              "returned); send n")
        if self.echo and self.logprobs is not None and self.stream and self.n > 1:
            raise unsupported("echo", "with logprobs, a stream echoes the prompt for n = 1 "
                              "only; send stream false or n 1")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def engine_prompt_logprobs(self) -> int | None:
        if self.prompt_logprobs is None and self.echo and self.logprobs is not None:
            return self.logprobs  # echo shows the prompt's logprobs (vLLM does the same)
        return self.prompt_logprobs

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the batch: a text or a list of token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]
        return list(self.prompt)


class TokenizeRequest(RequestBody):
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


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[TokenId]


# -- request mapping ---------------------------------------------------------------------

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
        prompt_logprobs=body.engine_prompt_logprobs,
    )


def output_options(body: GenerationBody) -> OutputOptions:
    """What the body asks of its response beyond the choices' text and logprobs."""
    stream_options = body.stream_options or StreamOptions()
    return OutputOptions(
        n=body.n, include_usage=stream_options.include_usage,
        continuous_usage=stream_options.continuous_usage_stats,
        obfuscate=stream_options.include_obfuscation,
        served_tier=body.served_tier,
        num_prompt_logprobs=body.prompt_logprobs,
        echo=isinstance(body, CompletionRequest) and body.echo)


def num_top_logprobs(body: GenerationBody) -> int | None:
    """How many alternatives each logprobs entry shows; None when logprobs are off."""
    logprobs, top_logprobs = _logprob_request(body)
    return top_logprobs if logprobs else None


def _logprob_request(body: GenerationBody) -> tuple[bool, int]:
    if isinstance(body, ChatCompletionRequest):
        return body.logprobs, body.top_logprobs or 0
    return body.logprobs is not None, body.logprobs or 0


def detok_options(body: GenerationBody, request_id: str,
                  tool_calls: ToolCallParsing | None = None) -> DetokOptions:
    return DetokOptions(
        request_id=request_id,
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
            content=m.text,
            parts=m.text_parts,
            name=m.name or "",
            tool_call_id=m.tool_call_id or "",
            tool_calls_json=json.dumps(m.tool_calls) if m.tool_calls else "",
        )
        for m in messages
    ]
