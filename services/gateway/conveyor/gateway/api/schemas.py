"""The OpenAI request bodies (and vLLM's extensions), validated once: a field in neither
schema is a 400 naming it, as OpenAI answers; a field of OpenAI's schema that this server
cannot honour is a 400 naming it when it is set; what each field does is listed in
docs/api.md. Ranges follow OpenAI's API reference."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, create_model, field_validator, model_validator

from conveyor.common.sampling_fields import (
    INT32_MAX,
    INT32_MIN,
    KNOBS,
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORDS,
    MAX_TOP_LOGPROBS,
    UINT32_MAX,
    Knob,
)
from conveyor.gateway.api.fields import (
    RequestBody,
    StreamOptions,
    TokenCount,
    TokenId,
    refuse_set_fields,
    unsupported,
)
from conveyor.gateway.api.tools import (
    ChatMessage,
    ResponseFormatField,
    StructuredOutputsParams,
    Tool,
    ToolChoice,
)


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
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1)
    """vLLM's: sample only among these token ids."""
    bad_words: list[Annotated[str, Field(min_length=1, max_length=MAX_BAD_WORD_CHARS)]] | None \
        = Field(None, max_length=MAX_BAD_WORDS)
    """vLLM's: words the output never contains (their token sequences are never completed)."""
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
    return_tokens_as_token_ids: bool = False
    """vLLM's: every token logprobs show is "token_id:{id}" instead of its text."""
    return_token_ids: bool = False
    """vLLM's: the prompt's token ids and each choice's output token ids in the response."""
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT32_MAX)
    """vLLM's: keep only the prompt's last k tokens (-1: the last max_model_len)."""
    cache_salt: str | None = Field(None, min_length=1)
    """vLLM's: mixed into the prefix cache's keys with the tenant's id, so only the tenant's
    requests with the same salt share cached blocks (Tenant.cache_salt_with)."""
    response_format: ResponseFormatField | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _keeps_some(cls, keep: int | None) -> int | None:
        if keep == 0:
            raise ValueError("must be -1 (the model's context length) or at least 1")
        return keep

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
    """True: the complete completion is kept for the caller's tenant (stored_chat/)."""
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
    documents: list[dict[str, str]] | None = None
    """vLLM's: a RAG request's sources, for templates that read them (else written into
    the system message by the tokenizer)."""
    echo: bool = False
    """vLLM's: an assistant's last message (the one the model continues) before each
    choice's content."""

    @property
    def echoed_text(self) -> str:
        """What echo puts before each choice's content ("" unless the last message is the
        assistant's)."""
        last = self.messages[-1]
        if not self.echo or last.role != "assistant":
            return ""
        return last.text or "".join(last.text_parts)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @model_validator(mode="after")
    def _refused_fields(self):
        refuse_set_fields(self, _REFUSED_CHAT_FIELDS)
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
    """vLLM's /tokenize: a prompt, or a conversation with the template fields chat has."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    documents: list[dict[str, str]] | None = None
    return_token_strs: bool = False
    """Also answer each token's string from the vocabulary (`token_strs`, e.g. "Ġworld")."""

    @model_validator(mode="after")
    def _prompt_or_messages(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[TokenId]
