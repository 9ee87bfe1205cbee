"""The engines' client: unary calls (stats, info, LoRA adapters) over one channel per
engine (their Generate stream is detok's to open: clients/detok.py); the records of a
Generate job and of what engines answer, and their one conversion to and from protobuf."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from enum import Enum

import grpc

from conveyor.common.engine_registry import DEFAULT_BLOCK_SIZE, EngineLoad
from conveyor.common.grpc_client import DEFAULT_KEEPALIVE, Channels, Keepalive
from conveyor.common.sampling_fields import sample_seed
from conveyor.gateway.clients.upstream import translate_rpc_errors
from conveyor.v1 import engine_pb2, engine_pb2_grpc

# -- records -----------------------------------------------------------------------------

@dataclass(slots=True)
class SamplingOptions:
    """How the engine samples one request. `knobs`: the optional parameters of the shared
    table (conveyor.common.sampling_fields) the client set, by name; the engine takes the
    table's default for the others."""

    max_tokens: int
    knobs: dict[str, float | int] = field(default_factory=dict)
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop_token_ids: list[int] = field(default_factory=list)
    allowed_token_ids: list[int] = field(default_factory=list)
    """Sample only among these (empty: any token)."""
    bad_words: list[list[int]] = field(default_factory=list)
    """Token sequences whose last token is never sampled right after the others."""
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
class EngineFacts:
    """Static facts about an engine (Engine.Info)."""

    model: str
    max_model_len: int
    engine_id: str
    max_loras: int = 0
    """Most distinct LoRA adapters in one step (0: it serves none)."""
    block_size: int = 16
    """Tokens per KV block."""


# -- client ------------------------------------------------------------------------------

SERVICE = "engine"


class EngineClient:
    """Unary calls to the engine at `address` over one shared channel (its Generate stream
    is detok's to open: clients/detok.py:DetokClient.generate)."""

    def __init__(self, address: str, channel: grpc.aio.Channel, rpc_timeout_s: float):
        self.address = address
        self._stub = engine_pb2_grpc.EngineStub(channel)
        self._timeout_s = rpc_timeout_s

    async def stats(self, timeout_s: float | None = None) -> EngineLoad:
        with translate_rpc_errors(SERVICE):
            reply = await self._stub.Stats(
                engine_pb2.EngineStatsRequest(), timeout=timeout_s or self._timeout_s
            )
        return EngineLoad.from_stats(reply)

    async def info(self) -> EngineFacts:
        with translate_rpc_errors(SERVICE):
            reply = await self._stub.Info(engine_pb2.EngineInfoRequest(), timeout=self._timeout_s)
        return engine_facts(reply)

    async def load_lora_adapter(self, adapter: LoraAdapter) -> LoraAdapterFacts:
        """Have the engine read `adapter` (UpstreamError INVALID_ARGUMENT if it cannot)."""
        with translate_rpc_errors(SERVICE):
            reply = await self._stub.LoadLoraAdapter(lora_adapter(adapter),
                                                     timeout=self._timeout_s)
        return lora_adapter_facts(reply)

    async def unload_lora_adapter(self, name: str) -> None:
        """Have the engine drop adapter `name` (UpstreamError NOT_FOUND if it holds none)."""
        with translate_rpc_errors(SERVICE):
            await self._stub.UnloadLoraAdapter(lora_adapter(LoraAdapter(name, "")),
                                               timeout=self._timeout_s)


class EngineClients:
    """The engines' clients over one channel cache; `close()` closes every channel opened."""

    def __init__(self, rpc_timeout_s: float, keepalive: Keepalive = DEFAULT_KEEPALIVE):
        self._rpc_timeout_s = rpc_timeout_s
        self._channels = Channels(keepalive)

    def client(self, address: str) -> EngineClient:
        """A client of the engine at `address` (host:port) for as long as the caller keeps
        it (a configured engine's); its channel stays open. Never awaits."""
        return EngineClient(address, self._channels.channel(address), self._rpc_timeout_s)

    @contextlib.asynccontextmanager
    async def lease(self, address: str) -> AsyncIterator[EngineClient]:
        """A client of the engine at `address` for the calls made in the block (an engine
        found in the registry, which a restart moves to another address): channels no
        call uses are closed past a few."""
        async with self._channels.lease(address) as channel:
            yield EngineClient(address, channel, self._rpc_timeout_s)

    async def close(self) -> None:
        await self._channels.close()


# -- protobuf ----------------------------------------------------------------------------

FINISH_REASONS = {
    engine_pb2.FINISH_REASON_STOP: FinishReason.STOP,
    engine_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    engine_pb2.FINISH_REASON_ABORT: FinishReason.ABORT,
}


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
        allowed_token_ids=options.allowed_token_ids,
        bad_words=[engine_pb2.TokenSequence(ids=ids) for ids in options.bad_words],
        ignore_eos=options.ignore_eos,
        logprobs=options.logprobs,
        top_logprobs=options.top_logprobs,
        min_tokens=options.min_tokens,
        prompt_logprobs=options.prompt_logprobs,
    )
    for name, value in options.knobs.items():  # the proto's optional field of that name
        setattr(params, name, value)
    return params


def position_logprobs(message: engine_pb2.PositionLogprobs) -> PositionLogprobs:
    return PositionLogprobs(
        logprob=message.logprob, top=[(t.token_id, t.logprob) for t in message.top],
        rank=message.rank,
    )


def engine_facts(message: engine_pb2.EngineInfo) -> EngineFacts:
    return EngineFacts(
        model=message.model, max_model_len=message.max_model_len, engine_id=message.engine_id,
        max_loras=message.max_loras,
        block_size=message.block_size or DEFAULT_BLOCK_SIZE,  # 0: an Info without it
    )
