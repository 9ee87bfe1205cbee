"""The Detokenizer gRPC servicer: converts proto messages to and from the
stream's domain types (nothing past this file imports *_pb2)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

import grpc

from conveyor.common.errors import ERROR_REASON_KEY, INVALID_REQUEST
from conveyor.common.log import request_id_var
from conveyor.detok.decode_options import DecodeOptions
from conveyor.detok.errors import InvalidStreamError
from conveyor.detok.offered_tools import ToolSpec
from conveyor.detok.stream import DetokenizeStream, StreamOutput, StreamStart
from conveyor.detok.tool_call_formats import ToolCallFormat
from conveyor.detok.tool_call_stream import ToolCallOptions
from conveyor.v1 import detok_pb2, detok_pb2_grpc

log = logging.getLogger("conveyor.detok")


class DetokenizerServicer(detok_pb2_grpc.DetokenizerServicer):
    """One DetokenizeStream per call, fed by the caller's messages.

    The call ends after a stop match, after a message with `finish`, or when
    the caller half-closes (treated as `finish`). Bad input aborts the call
    with INVALID_ARGUMENT and the reason `invalid_request` in the trailing
    metadata.
    """

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    async def Detokenize(self, request_iterator, context) -> AsyncIterator:
        try:
            async for output in self._outputs(request_iterator):
                yield _to_proto(output)
        except InvalidStreamError as exc:
            await _abort_invalid(context, str(exc))

    async def _outputs(self, request_iterator) -> AsyncIterator[StreamOutput]:
        stream: DetokenizeStream | None = None
        async for message in request_iterator:
            if stream is None:
                stream = self._open(message)
            elif message.HasField("start"):
                raise InvalidStreamError("`start` may only be set on the first message of a stream")
            output = _handle(stream, message)
            if not output.is_empty:
                yield output
            if stream.is_finished:
                return
        if stream is not None:
            output = stream.finish()
            if not output.is_empty:
                yield output

    def _open(self, message) -> DetokenizeStream:
        if not message.HasField("start"):
            raise InvalidStreamError("the first Detokenize message must carry `start`")
        start = _start_from_proto(message.start)
        if start.request_id and request_id_var.get() is None:
            request_id_var.set(start.request_id)
        log.debug("stream opened with %d stop strings", len(start.stops))
        return DetokenizeStream(self._tokenizer, start)


def _handle(stream: DetokenizeStream, message) -> StreamOutput:
    output = stream.feed(list(message.token_ids))
    if message.finish and not stream.is_finished:
        return _merge(output, stream.finish())
    return output


def _merge(first: StreamOutput, second: StreamOutput) -> StreamOutput:
    return StreamOutput(first.text + second.text, second.num_tokens, second.stop_match,
                        first.tool_calls + second.tool_calls)


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
        prompt_tail_ids=list(start.prompt_tail_token_ids),
        stops=list(start.stop),
        include_stop_str_in_output=start.include_stop_str_in_output,
        options=options,
        tool_calls=_tool_call_options(start),
    )


def _to_proto(output: StreamOutput):
    response = detok_pb2.DetokenizeResponse(
        text_delta=output.text, num_tokens=output.num_tokens,
        tool_calls=[detok_pb2.ToolCallDelta(index=d.index, id=d.id, name=d.name,
                                            arguments=d.arguments) for d in output.tool_calls])
    if output.stop_match is not None:
        match = output.stop_match
        response.stop_match.CopyFrom(detok_pb2.StopMatch(
            stop=match.stop, stop_index=match.stop_index, num_tokens=match.num_tokens))
    return response


async def _abort_invalid(context, message: str) -> None:
    context.set_trailing_metadata(((ERROR_REASON_KEY, INVALID_REQUEST),))
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
