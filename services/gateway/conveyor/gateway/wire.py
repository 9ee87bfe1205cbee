"""What the gateway sends to and reads from its gRPC services, as plain data, and the one
place that converts it to and from protobuf.

Records: a prompt to render or tokenize and the tokens that come back (tokenizer), a
Generate job with its sampling options (and LoRA adapter) and the loads and facts an
engine answers (engine), and the text options of a generation and the deltas detok
streams back for it (detok opens the engine's stream: the gateway's job goes there). The
conversions (`render_request`, `text_generate_request`, `generation_delta`, ...) are the only
code past this module that touches `*_pb2`; a failed call becomes an `UpstreamError`
(`translate_rpc_errors`), never a gRPC exception.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum

import grpc

from conveyor.common.errors import ERROR_REASON_KEY, ERROR_SERVICE_KEY
from conveyor.common.sampling_fields import sample_seed
from conveyor.v1 import detok_pb2, engine_pb2, tokenizer_pb2

# -- tokenizer records -------------------------------------------------------------------

@dataclass(slots=True)
class ChatTurn:
    """One chat message; `parts` (text pieces) win over `content` when given."""

    role: str
    content: str = ""
    parts: list[str] = field(default_factory=list)
    name: str = ""
    tool_call_id: str = ""
    tool_calls_json: str = ""


@dataclass(slots=True)
class RenderInput:
    """A conversation to render with the chat template and tokenize."""

    messages: list[ChatTurn]
    max_tokens: int = 0
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str = ""
    tools_json: str = ""
    chat_template_kwargs_json: str = ""


@dataclass(slots=True)
class PromptInput:
    """A plain prompt: text or token ids (exactly one of them)."""

    text: str | None = None
    token_ids: list[int] | None = None
    add_special_tokens: bool = True
    max_tokens: int = 0


@dataclass(slots=True)
class PromptTokens:
    """A tokenized prompt and the model's context length."""

    token_ids: list[int]
    prompt_text: str
    max_model_len: int

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class TokenizerFacts:
    """What the tokenizer serves (Tokenizer.Info)."""

    model: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]


# -- engine records ----------------------------------------------------------------------

@dataclass(slots=True)
class SamplingOptions:
    """How the engine samples one request. `knobs`: the optional parameters of the shared
    table (conveyor.common.sampling_fields) the client set, by name; the engine takes the
    table's default for the others."""

    max_tokens: int
    knobs: dict[str, float | int] = field(default_factory=dict)
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    min_tokens: int = 0
    prompt_logprobs: int | None = None
    """Alternatives per prompt position of the prompt's logprobs (None: none)."""


class ConstraintKind(Enum):
    """The kinds of structured output, named as the proto's StructuredOutput fields."""

    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"


@dataclass(frozen=True, slots=True)
class Constraint:
    """What the output must match: a JSON schema's text, a regex, a grammar's text, the
    choice's options, or (JSON_OBJECT) nothing more."""

    kind: ConstraintKind
    value: str | tuple[str, ...] = ""


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """A LoRA adapter: the name requests use and its folder as the engines see it."""

    name: str
    path: str


@dataclass(frozen=True, slots=True)
class LoraAdapterFacts:
    """An adapter as an engine read it (LoadLoraAdapter's answer)."""

    name: str
    rank: int
    target_modules: tuple[str, ...] = ()


@dataclass(slots=True)
class GenerateJob:
    """One Generate call: a prompt and how to continue it, `n` samples of it (the engine
    computes the prompt once; each chunk names its sample)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    priority: int = 0
    cache_salt: str = ""
    resume_output_token_ids: list[int] = field(default_factory=list)
    """Output an earlier engine produced (a moved stream); the engine continues after it."""
    n: int = 1
    constraint: Constraint | None = None
    lora: LoraAdapter | None = None
    """The adapter to run with (None: the base model)."""

    def sample(self, index: int, request_id: str) -> GenerateJob:
        """Sample `index` of this job as a job of its own (n = 1), drawing as it does here
        (seed + index); a sample of a shared stream moves to another engine in this form."""
        if self.n == 1:
            return self
        knobs = dict(self.sampling.knobs)
        if knobs.get("seed") is not None:
            knobs["seed"] = sample_seed(knobs["seed"], index)
        sampling = dataclasses.replace(self.sampling, knobs=knobs)
        return dataclasses.replace(self, request_id=request_id, sampling=sampling, n=1)

    def resumed(self, output_token_ids: list[int]) -> GenerateJob:
        """This job continued on another engine after `output_token_ids` (its prompt's
        logprobs came with its first output already)."""
        sampling = dataclasses.replace(self.sampling, prompt_logprobs=None)
        return dataclasses.replace(self, sampling=sampling,
                                   resume_output_token_ids=list(output_token_ids))


class FinishReason(Enum):
    """Why the engine stopped a request."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(slots=True)
class PositionLogprobs:
    """The sampled (or, for a prompt position, the prompt's) token's logprob and the best
    alternatives (token id, logprob); `rank` is given for prompt positions only (0: not)."""

    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int = 0


@dataclass(slots=True)
class TokenUsage:
    """Token counts of one request."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    draft_tokens: int = 0
    """Draft tokens speculative decoding verified (0 when it is off)."""
    accepted_draft_tokens: int = 0
    """Of those, the ones accepted."""


@dataclass(slots=True)
class GenerationDelta:
    """What one response of a detok Generate stream carries for sample `index`: new
    content text, pieces of tool calls, and the output tokens they came from (with their
    logprobs, if asked for); the sample's last delta has a finish_reason ("stop",
    "length", or "abort": the engine gave the request up), the stop reason (stop string
    or token id) and the usage. The first delta of a request whose engine computed prompt
    logprobs carries them (prompt positions 1 .. len - 1)."""

    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    usage: TokenUsage | None = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs] = field(default_factory=list)
    index: int = 0


@dataclass(slots=True)
class EngineFacts:
    """Static facts about an engine (Engine.Info)."""

    model: str
    max_model_len: int
    engine_id: str
    max_loras: int = 0
    """Most distinct LoRA adapters in one step (0: it serves none)."""


# -- detok records -----------------------------------------------------------------------

class ToolCallFormat(Enum):
    """How a model's text carries tool calls (detok.proto's ToolCallFormat)."""

    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"
    JSON_ARRAY = "json_array"
    NAMED = "named"


@dataclass(frozen=True, slots=True)
class OfferedTool:
    """A function the model may call: its name, parameters schema (JSON text; empty: any
    object) and whether its calls must validate against it."""

    name: str
    parameters_json: str = ""
    strict: bool = False


@dataclass(frozen=True, slots=True)
class ToolCallParsing:
    """Which tool calls detok reads out of a stream's text."""

    format: ToolCallFormat
    function_name: str = ""
    """The function a NAMED stream calls."""
    max_calls: int = 0
    """Most calls kept (0: no limit)."""
    tools: tuple[OfferedTool, ...] = ()
    """The functions offered: calls of others, and strict ones' invalid calls, stay text."""


@dataclass(slots=True)
class DetokOptions:
    """How a request's tokens become text (detok.proto's DetokenizeStart)."""

    request_id: str
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    tool_calls: ToolCallParsing | None = None


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of tool call `index`: its id and name (first piece) or an arguments fragment."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


@dataclass(slots=True)
class TextSoFar:
    """What a caller has of a generation's text: content characters, and per tool call it
    has the header of, its arguments' characters (a resumed stream holds them back)."""

    num_chars: int = 0
    argument_chars: list[int] = field(default_factory=list)


# -- upstream error ----------------------------------------------------------------------

class UpstreamError(Exception):
    """A gRPC call failed: which service, the status code's name, its message and
    the machine-readable reason from the trailing metadata (None when absent)."""

    def __init__(self, service: str, code: str, message: str, reason: str | None = None):
        super().__init__(f"{service}: {code}: {message}")
        self.service = service
        self.code = code
        self.message = message
        self.reason = reason

    @classmethod
    def from_rpc(cls, service: str, error: grpc.aio.AioRpcError) -> UpstreamError:
        """`service`'s failed call; a failure it passed on names its own service (detok
        passes on its engine's)."""
        return cls(_metadata(error, ERROR_SERVICE_KEY) or service, error.code().name,
                   error.details() or "", _metadata(error, ERROR_REASON_KEY))


def _metadata(error: grpc.aio.AioRpcError, wanted: str) -> str | None:
    for key, value in error.trailing_metadata() or ():
        if key == wanted:
            return value.decode() if isinstance(value, bytes) else value
    return None


@contextlib.contextmanager
def translate_rpc_errors(service: str) -> Iterator[None]:
    """Re-raise a gRPC error raised inside the block as UpstreamError."""
    try:
        yield
    except grpc.aio.AioRpcError as error:
        raise UpstreamError.from_rpc(service, error) from error


# -- convert -----------------------------------------------------------------------------

_FINISH_REASONS = {
    engine_pb2.FINISH_REASON_STOP: FinishReason.STOP,
    engine_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    engine_pb2.FINISH_REASON_ABORT: FinishReason.ABORT,
}


# -- engine -----------------------------------------------------------------------------------

def generate_request(job: GenerateJob) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(
        request_id=job.request_id,
        prompt_token_ids=job.prompt_token_ids,
        sampling=sampling_params(job.sampling),
        priority=job.priority,
        cache_salt=job.cache_salt,
        resume_output_token_ids=job.resume_output_token_ids,
        n=job.n,
        structured_output=_structured_output(job.constraint),
        lora=None if job.lora is None else lora_adapter(job.lora),
    )


def lora_adapter(adapter: LoraAdapter) -> engine_pb2.LoraAdapter:
    return engine_pb2.LoraAdapter(name=adapter.name, path=adapter.path)


def lora_adapter_facts(message: engine_pb2.LoraAdapterInfo) -> LoraAdapterFacts:
    return LoraAdapterFacts(message.name, message.rank, tuple(message.target_modules))


def _structured_output(constraint: Constraint | None) -> engine_pb2.StructuredOutput | None:
    if constraint is None:
        return None
    kind = constraint.kind
    if kind is ConstraintKind.JSON_OBJECT:
        return engine_pb2.StructuredOutput(json_object=True)
    if kind is ConstraintKind.CHOICE:
        return engine_pb2.StructuredOutput(
            choice=engine_pb2.StringChoice(options=constraint.value))
    return engine_pb2.StructuredOutput(**{kind.value: constraint.value})


def sampling_params(options: SamplingOptions) -> engine_pb2.SamplingParams:
    params = engine_pb2.SamplingParams(
        max_tokens=options.max_tokens,
        logit_bias=options.logit_bias,
        stop_token_ids=options.stop_token_ids,
        ignore_eos=options.ignore_eos,
        logprobs=options.logprobs,
        top_logprobs=options.top_logprobs,
        min_tokens=options.min_tokens,
        prompt_logprobs=options.prompt_logprobs,
    )
    for name, value in options.knobs.items():  # the proto's optional field of that name
        setattr(params, name, value)
    return params


def _position_logprobs(message: engine_pb2.PositionLogprobs) -> PositionLogprobs:
    return PositionLogprobs(
        logprob=message.logprob, top=[(t.token_id, t.logprob) for t in message.top],
        rank=message.rank,
    )


def stats_request() -> engine_pb2.EngineStatsRequest:
    return engine_pb2.EngineStatsRequest()


def engine_info_request() -> engine_pb2.EngineInfoRequest:
    return engine_pb2.EngineInfoRequest()


def engine_facts(message: engine_pb2.EngineInfo) -> EngineFacts:
    return EngineFacts(
        model=message.model, max_model_len=message.max_model_len, engine_id=message.engine_id,
        max_loras=message.max_loras,
    )


# -- tokenizer --------------------------------------------------------------------------------

def render_request(render: RenderInput) -> tokenizer_pb2.RenderRequest:
    return tokenizer_pb2.RenderRequest(
        messages=[_chat_message(m) for m in render.messages],
        add_generation_prompt=render.add_generation_prompt,
        continue_final_message=render.continue_final_message,
        chat_template=render.chat_template,
        tools_json=render.tools_json,
        max_tokens=render.max_tokens,
        chat_template_kwargs_json=render.chat_template_kwargs_json,
    )


def _chat_message(turn: ChatTurn) -> tokenizer_pb2.ChatMessage:
    return tokenizer_pb2.ChatMessage(
        role=turn.role,
        content=turn.content,
        parts=[tokenizer_pb2.ContentPart(type="text", text=text) for text in turn.parts],
        name=turn.name,
        tool_call_id=turn.tool_call_id,
        tool_calls_json=turn.tool_calls_json,
    )


def tokenize_request(prompt: PromptInput) -> tokenizer_pb2.TokenizeRequest:
    request = tokenizer_pb2.TokenizeRequest(
        add_special_tokens=prompt.add_special_tokens, max_tokens=prompt.max_tokens
    )
    if prompt.token_ids is not None:
        request.token_ids.ids.extend(prompt.token_ids)
    else:
        request.text = prompt.text or ""
    return request


def prompt_tokens(message: tokenizer_pb2.TokenizeResponse) -> PromptTokens:
    return PromptTokens(
        token_ids=list(message.token_ids),
        prompt_text=message.prompt_text,
        max_model_len=message.max_model_len,
    )


def decode_request(token_ids: list[int], skip_special_tokens: bool,
                   each_token: bool = False) -> tokenizer_pb2.DecodeRequest:
    return tokenizer_pb2.DecodeRequest(token_ids=token_ids, skip_special_tokens=skip_special_tokens,
                                       each_token=each_token)


def decoded_text(message: tokenizer_pb2.DecodeResponse) -> str:
    return message.text


def decoded_token_texts(message: tokenizer_pb2.DecodeResponse) -> list[str]:
    return list(message.token_texts)


def tokenizer_info_request() -> tokenizer_pb2.TokenizerInfoRequest:
    return tokenizer_pb2.TokenizerInfoRequest()


def tokenizer_facts(message: tokenizer_pb2.TokenizerInfo) -> TokenizerFacts:
    return TokenizerFacts(
        model=message.model,
        vocab_size=message.vocab_size,
        max_model_len=message.max_model_len,
        eos_token_ids=list(message.eos_token_ids),
    )


# -- detok ------------------------------------------------------------------------------------

def text_generate_request(engine_address: str, job: GenerateJob, options: DetokOptions,
                          sample_ids: list[str], so_far: TextSoFar | None
                          ) -> detok_pb2.TextGenerateRequest:
    return detok_pb2.TextGenerateRequest(
        engine_address=engine_address,
        generate=generate_request(job),
        detok=detok_pb2.DetokenizeStart(
            request_id=options.request_id,
            stop=options.stop,
            include_stop_str_in_output=options.include_stop_str_in_output,
            skip_special_tokens=options.skip_special_tokens,
            spaces_between_special_tokens=options.spaces_between_special_tokens,
            tool_calls=_tool_call_options(options.tool_calls),
        ),
        sample_ids=sample_ids,
        text_so_far=None if so_far is None else detok_pb2.TextSoFar(
            num_chars=so_far.num_chars, tool_call_argument_chars=so_far.argument_chars),
    )


_TOOL_CALL_FORMATS = {
    ToolCallFormat.HERMES: detok_pb2.TOOL_CALL_FORMAT_HERMES,
    ToolCallFormat.LLAMA3_JSON: detok_pb2.TOOL_CALL_FORMAT_LLAMA3_JSON,
    ToolCallFormat.JSON_ARRAY: detok_pb2.TOOL_CALL_FORMAT_JSON_ARRAY,
    ToolCallFormat.NAMED: detok_pb2.TOOL_CALL_FORMAT_NAMED,
}


def _tool_call_options(parsing: ToolCallParsing | None) -> detok_pb2.ToolCallOptions | None:
    if parsing is None:
        return None
    return detok_pb2.ToolCallOptions(
        format=_TOOL_CALL_FORMATS[parsing.format], function_name=parsing.function_name,
        max_calls=parsing.max_calls,
        tools=[detok_pb2.ToolSpec(name=t.name, parameters_json=t.parameters_json,
                                  strict=t.strict) for t in parsing.tools])


def generation_delta(message: detok_pb2.TextGenerateResponse) -> GenerationDelta:
    finish = _FINISH_REASONS.get(message.finish_reason)
    stop = message.WhichOneof("stop_reason")
    usage = message.usage
    return GenerationDelta(
        text=message.text_delta,
        token_ids=list(message.token_ids),
        logprobs=[_position_logprobs(p) for p in message.logprobs],
        finish_reason=None if finish is None else finish.value,
        stop_reason=None if stop is None else getattr(message, stop),
        usage=TokenUsage(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens,
                         usage.draft_tokens, usage.accepted_draft_tokens),
        tool_calls=[ToolCallDelta(d.index, d.id, d.name, d.arguments) for d in message.tool_calls],
        prompt_logprobs=[_position_logprobs(p) for p in message.prompt_logprobs],
        index=message.index,
    )
