"""The Detokenizer gRPC servicer: opens the engine's stream and converts proto messages
to and from the domain types of text_generation.py (nothing past this file imports
*_pb2; the engine's logprobs and usage pass through as they came, with the texts of the
tokens they show)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Iterator

import grpc

from conveyor.common.errors import ERROR_REASON_KEY, ERROR_SERVICE_KEY, INVALID_REQUEST
from conveyor.common.grpc_client import Channels
from conveyor.common.log import request_id_var
from conveyor.common.sampling_fields import MAX_NUM_SAMPLES
from conveyor.detok.decode_options import DecodeOptions
from conveyor.detok.errors import InvalidStreamError
from conveyor.detok.offered_tools import ToolSpec
from conveyor.detok.stream import StreamStart
from conveyor.detok.text_generation import KnownText, SampleText, TextGeneration
from conveyor.detok.token_texts import TokenTexts
from conveyor.detok.tool_call_formats import ToolCallFormat
from conveyor.detok.tool_call_stream import ToolCallOptions
from conveyor.v1 import detok_pb2, detok_pb2_grpc, engine_pb2, engine_pb2_grpc

log = logging.getLogger("conveyor.detok")

ENGINE_SERVICE = "engine"


class DetokenizerServicer(detok_pb2_grpc.DetokenizerServicer):
    """One TextGeneration per call, fed by the engine's Generate stream (opened on
    `engines`, one channel per engine address, leased for the call).

    Bad input aborts the call with INVALID_ARGUMENT and the reason `invalid_request` in
    the trailing metadata; the engine's failure is passed on as it came, its service
    named in the trailing metadata. The engine's stream is cancelled on every way out.
    """

    def __init__(self, tokenizer, engines: Channels):
        self._tokenizer = tokenizer
        self._engines = engines
        self._token_texts = TokenTexts(tokenizer)

    async def Generate(self, request, context) -> AsyncIterator:
        try:
            generation = self._open(request)
        except InvalidStreamError as exc:
            await _abort_invalid(context, str(exc))
        async with self._engines.lease(request.engine_address) as channel:
            call = engine_pb2_grpc.EngineStub(channel).Generate(request.generate)
            try:
                async for chunk in call:
                    response = _response(generation, chunk, self._token_texts,
                                         request.generate.prompt_token_ids)
                    if response is not None:
                        yield response
                    if generation.is_finished:
                        return
            except grpc.aio.AioRpcError as error:
                await _abort_passed_on(context, error)
            except InvalidStreamError as exc:
                await context.abort(grpc.StatusCode.INTERNAL, f"the engine's output: {exc}")
            finally:
                call.cancel()

    def _open(self, request) -> TextGeneration:
        if not request.engine_address:
            raise InvalidStreamError("engine_address is required")
        if request.generate.n > MAX_NUM_SAMPLES:
            raise InvalidStreamError(f"generate.n must be at most {MAX_NUM_SAMPLES}, got "
                                     f"{request.generate.n}")
        _check_request_id(request.detok.request_id)
        start = _start_from_proto(request.detok)
        if start.request_id and request_id_var.get() is None:
            request_id_var.set(start.request_id)
        generate = request.generate
        known = (KnownText(request.text_so_far.num_chars,
                           list(request.text_so_far.tool_call_argument_chars))
                 if request.HasField("text_so_far") else None)
        log.debug("generation opened on %s with %d stop strings", request.engine_address,
                  len(start.stops))
        return TextGeneration(self._tokenizer, start, list(generate.prompt_token_ids),
                              _sample_ids(request), list(generate.resume_output_token_ids),
                              known)


MAX_REQUEST_ID_CHARS = 256


def _check_request_id(request_id: str) -> None:
    """A request id travels as gRPC metadata (x-request-id): printable ASCII, bounded."""
    if len(request_id) > MAX_REQUEST_ID_CHARS or not (request_id.isascii()
                                                       and request_id.isprintable()):
        raise InvalidStreamError(f"detok.request_id must be printable ASCII of at most "
                                 f"{MAX_REQUEST_ID_CHARS} characters")


def _sample_ids(request) -> list[str]:
    """Each sample's id: sample_ids, else the request id (n = 1) or it with the index."""
    n = max(1, request.generate.n)
    if request.sample_ids:
        if len(request.sample_ids) != n:
            raise InvalidStreamError(f"sample_ids has {len(request.sample_ids)} ids for "
                                     f"n = {n} samples")
        return list(request.sample_ids)
    request_id = request.detok.request_id
    return [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]


_ENDS = (engine_pb2.FINISH_REASON_STOP, engine_pb2.FINISH_REASON_LENGTH)
"""The engine's finishes that end a sample's text (an abort does not: the caller resumes
it elsewhere, so held-back text stays held)."""


def _response(generation: TextGeneration, chunk, token_texts: TokenTexts,
              prompt_ids) -> detok_pb2.TextGenerateResponse | None:
    """The response for one engine chunk; None for a sample that already ended."""
    text = generation.push(chunk.index, list(chunk.token_ids), chunk.finish_reason in _ENDS)
    if text is None:
        return None
    kept = text.num_tokens
    response = detok_pb2.TextGenerateResponse(
        index=chunk.index, text_delta=text.text, tool_calls=_tool_calls(text),
        token_ids=chunk.token_ids[:kept], logprobs=chunk.logprobs[:kept],
        prompt_logprobs=chunk.prompt_logprobs, usage=chunk.usage)
    if response.logprobs or response.prompt_logprobs:
        response.token_texts.update(token_texts.texts(_shown_ids(response, prompt_ids)))
    if text.stop is not None:
        response.finish_reason = engine_pb2.FINISH_REASON_STOP
        response.stop_string = text.stop
        response.usage.completion_tokens = text.num_output_tokens
    else:
        response.finish_reason = chunk.finish_reason
        if chunk.HasField("stop_token_id"):
            response.stop_token_id = chunk.stop_token_id
    return response


def _shown_ids(response: detok_pb2.TextGenerateResponse, prompt_ids) -> Iterator[int]:
    """The ids whose text the response's logprobs show (detok.proto's token_texts)."""
    yield from response.token_ids[:len(response.logprobs)]
    if response.prompt_logprobs:
        yield from prompt_ids
    for position in (*response.logprobs, *response.prompt_logprobs):
        yield from (top.token_id for top in position.top)


def _tool_calls(text: SampleText) -> list[detok_pb2.ToolCallDelta]:
    return [detok_pb2.ToolCallDelta(index=d.index, id=d.id, name=d.name, arguments=d.arguments)
            for d in text.tool_calls]


_TOOL_CALL_FORMATS = {
    detok_pb2.TOOL_CALL_FORMAT_HERMES: ToolCallFormat.HERMES,
    detok_pb2.TOOL_CALL_FORMAT_LLAMA3_JSON: ToolCallFormat.LLAMA3_JSON,
    detok_pb2.TOOL_CALL_FORMAT_JSON_ARRAY: ToolCallFormat.JSON_ARRAY,
    detok_pb2.TOOL_CALL_FORMAT_NAMED: ToolCallFormat.NAMED,
}


def _tool_call_options(start) -> ToolCallOptions | None:
    if not start.HasField("tool_calls") or not start.tool_calls.format:
        return None
    options = start.tool_calls
    if options.format not in _TOOL_CALL_FORMATS:
        raise InvalidStreamError(f"tool_calls.format {options.format} is not a known format")
    if options.format == detok_pb2.TOOL_CALL_FORMAT_NAMED and not options.function_name:
        raise InvalidStreamError("tool_calls.function_name is required with the NAMED format")
    return ToolCallOptions(_TOOL_CALL_FORMATS[options.format], options.function_name,
                           options.max_calls, tuple(_tool_spec(t) for t in options.tools))


def _tool_spec(tool) -> ToolSpec:
    try:
        parameters = json.loads(tool.parameters_json) if tool.parameters_json else None
    except json.JSONDecodeError as error:
        raise InvalidStreamError(f"the parameters of tool {tool.name!r} are not JSON: "
                                 f"{error}") from None
    if parameters is not None and not isinstance(parameters, dict):
        raise InvalidStreamError(f"the parameters of tool {tool.name!r} must be a JSON object")
    return ToolSpec(tool.name, parameters, tool.strict)


def _start_from_proto(start) -> StreamStart:
    options = DecodeOptions(
        skip_special_tokens=start.skip_special_tokens,
        spaces_between_special_tokens=start.spaces_between_special_tokens,
    )
    return StreamStart(
        request_id=start.request_id,
        stops=list(start.stop),
        include_stop_str_in_output=start.include_stop_str_in_output,
        options=options,
        tool_calls=_tool_call_options(start),
    )


async def _abort_invalid(context, message: str) -> None:
    context.set_trailing_metadata(((ERROR_REASON_KEY, INVALID_REQUEST),))
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)


async def _abort_passed_on(context, error: grpc.aio.AioRpcError) -> None:
    """End the call as the engine's call ended: its code, message and reason, the engine
    named as the service that failed."""
    reasons = [(key, value) for key, value in error.trailing_metadata() or ()
               if key == ERROR_REASON_KEY]
    context.set_trailing_metadata((*reasons, (ERROR_SERVICE_KEY, ENGINE_SERVICE)))
    await context.abort(error.code(), error.details() or "")
