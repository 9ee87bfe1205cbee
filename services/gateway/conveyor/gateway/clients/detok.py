"""Detok's client: one server stream per generation (`DetokClient.generate`): detok opens
the engine's Generate stream and streams text with its tokens back (resuming a broken
stream is generation.py's); the records of a generation's text options and deltas, and
their one conversion to and from protobuf."""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass, field
from enum import Enum

from conveyor.common.replica_set import ReplicaSet
from conveyor.gateway.clients.engine import (
    FINISH_REASONS,
    GenerateJob,
    PositionLogprobs,
    TokenUsage,
    generate_request,
    position_logprobs,
)
from conveyor.gateway.clients.upstream import UpstreamError, translate_rpc_errors
from conveyor.v1 import detok_pb2, detok_pb2_grpc

# -- records -----------------------------------------------------------------------------

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
class GenerationDelta:
    """What one response of a detok Generate stream carries for sample `index`: new
    content text, pieces of tool calls, and the output tokens they came from (with their
    logprobs, if asked for); the sample's last delta has a finish_reason ("stop",
    "length", or "abort": the engine gave the request up), the stop reason (stop string
    or token id) and the usage. The first delta of a request whose engine computed prompt
    logprobs carries them (prompt positions 1 .. len - 1). `token_texts` has the text of
    every token id those logprobs show (detok's: each id decoded alone)."""

    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    usage: TokenUsage | None = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs] = field(default_factory=list)
    index: int = 0
    token_texts: dict[int, str] = field(default_factory=dict)


@dataclass(slots=True)
class TextSoFar:
    """What a caller has of a generation's text: content characters, and per tool call it
    has the header of, its arguments' characters (a resumed stream holds them back)."""

    num_chars: int = 0
    argument_chars: list[int] = field(default_factory=list)


# -- client ------------------------------------------------------------------------------

DETOK_SERVICE = "detok"


log = logging.getLogger("conveyor.gateway.detok")


class TextStream:
    """One detok Generate call: iterate it for GenerationDeltas. A failed call is an
    UpstreamError naming the service that failed (the engine's failure, passed on by
    detok, names the engine). `cancel()` ends the call (and so the engine's stream)."""

    def __init__(self, call, replica: str):
        self._call = call
        self.replica = replica
        """The detok replica's address."""

    async def __aiter__(self):
        with translate_rpc_errors(DETOK_SERVICE):
            async for message in self._call:
                yield generation_delta(message)

    def cancel(self) -> None:
        self._call.cancel()


class DetokClient:
    """Opens generations on the detok replicas (each opens the engine's stream)."""

    def __init__(self, replicas: ReplicaSet, rpc_timeout_s: float = 2.0):
        self._replicas = replicas
        self._timeout_s = rpc_timeout_s

    @property
    def max_attempts(self) -> int:
        """Most replicas one generation is tried on."""
        return self._replicas.max_attempts

    async def generate(self, engine_address: str, job: GenerateJob, options: DetokOptions,
                       sample_ids: list[str], so_far: TextSoFar | None = None,
                       exclude: Collection[str] = ()) -> TextStream:
        """`job` on the engine at `engine_address`, as text, through a replica not in
        `exclude` (UpstreamError UNAVAILABLE when none is left)."""
        with translate_rpc_errors(DETOK_SERVICE):
            replica = await self._replicas.pick(exclude=exclude)
        request = text_generate_request(engine_address, job, options, sample_ids, so_far)
        return TextStream(detok_pb2_grpc.DetokenizerStub(replica.channel).Generate(request),
                          replica.address)

    def failed(self, replica: str, error: UpstreamError, num_tokens: int) -> None:
        """A replica's call broke after `num_tokens` output tokens: pick around it for a
        while (the generation resumes on another)."""
        log.warning("detok replica %s failed (%s: %s); the generation resumes on another "
                    "after %d tokens", replica, error.code, error.message, num_tokens)
        self._replicas.mark_unreachable(replica)

    async def is_serving(self) -> bool:
        return await self._replicas.is_serving(self._timeout_s)

    async def close(self) -> None:
        await self._replicas.close()


# -- protobuf ----------------------------------------------------------------------------

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
    finish = FINISH_REASONS.get(message.finish_reason)
    stop = message.WhichOneof("stop_reason")
    usage = message.usage
    return GenerationDelta(
        text=message.text_delta,
        token_ids=list(message.token_ids),
        logprobs=[position_logprobs(p) for p in message.logprobs],
        finish_reason=None if finish is None else finish.value,
        stop_reason=None if stop is None else getattr(message, stop),
        usage=TokenUsage(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens,
                         usage.draft_tokens, usage.accepted_draft_tokens),
        tool_calls=[ToolCallDelta(d.index, d.id, d.name, d.arguments) for d in message.tool_calls],
        prompt_logprobs=[position_logprobs(p) for p in message.prompt_logprobs],
        index=message.index,
        token_texts=dict(message.token_texts),
    )
