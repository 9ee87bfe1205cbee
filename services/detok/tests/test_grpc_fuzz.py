"""The Detokenizer service fuzzed with malformed requests (hypothesis, derandomized): no
engine address, ids at the uint32 edges in the prompt and the resumed tokens, n and
sample_ids that disagree, text_so_far with or without resumed tokens, empty and huge
stop strings, unknown tool-call formats and broken tool schemas. Each call ends OK or
with INVALID_ARGUMENT and a message; never another status, a crash or a hang. In
process, real tokenizer, a scripted engine streaming three samples."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from detok_scripted_engine import Sample, ScriptedEngine
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from conveyor.common.grpc_client import Channels, open_channel
from conveyor.common.grpc_server import ServiceRegistration, start_grpc_server
from conveyor.common.settings import ServiceSettings
from conveyor.detok.servicer import DetokenizerServicer
from conveyor.v1 import detok_pb2, detok_pb2_grpc, engine_pb2

VALID_ID = st.integers(0, 49151)
IDS = st.one_of(VALID_ID, VALID_ID, VALID_ID, st.sampled_from([49152, 2**31, 2**32 - 1]))
UINT32 = st.one_of(st.integers(0, 8), st.sampled_from([2**31, 2**32 - 1]))
TEXT = st.one_of(st.text(min_size=1, max_size=6), st.text(min_size=1, max_size=6),
                 st.sampled_from(["", "\x00", "💥", ".", "x" * 5_000]))
PARAMETERS = st.sampled_from(["", "{", "[]", "null", '{"type": "object"}',
                              '{"type": "nonsense"}', '{"properties": {"a": {"type": "x"}}}'])
PRINTABLE_ASCII = st.characters(min_codepoint=0x20, max_codepoint=0x7E)
"""What a request id may hold: it travels on as the engine call's x-request-id metadata
(see test_a_request_id_that_is_no_metadata_value_is_not_the_engines_failure)."""
SAMPLE_TEXTS = ['Hi <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call> 😀 bye.',
                '{"name": "f", "parameters": {}}; plain. text', "你好"]
def mostly(default, strategy: st.SearchStrategy) -> st.SearchStrategy:
    """`default` three times in four (so most calls get past the first bad field)."""
    return st.one_of(st.just(default), st.just(default), st.just(default), strategy)


FUZZ = settings(max_examples=100, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


class RecordingServicer(DetokenizerServicer):
    """The real servicer, recording how each call ended on the server's side: "OK", the
    code it aborted with, or the exception that escaped it."""

    def __init__(self, tokenizer, engines: Channels):
        super().__init__(tokenizer, engines)
        self.outcomes: list = []

    async def Generate(self, request, context):
        try:
            async for reply in super().Generate(request, context):
                yield reply
        except grpc.aio.AbortError:
            self.outcomes.append(context.code().name)
            raise
        except BaseException as error:
            self.outcomes.append(error)
            raise
        self.outcomes.append("OK")


@pytest.fixture
async def stub(tokenizer, serve_engine):
    """(the detok stub, the servicer's outcomes, the engine's address)."""
    finishes = [engine_pb2.FINISH_REASON_STOP, engine_pb2.FINISH_REASON_LENGTH,
                engine_pb2.FINISH_REASON_ABORT]
    engine = ScriptedEngine(*(Sample(tokenizer.encode(text), chunk_sizes=(1, 3),
                                     finish_reason=finish)
                              for text, finish in zip(SAMPLE_TEXTS, finishes, strict=True)))
    engine_address = await serve_engine(engine)
    engines = Channels()
    servicer = RecordingServicer(tokenizer, engines)
    registration = ServiceRegistration("conveyor.v1.Detokenizer",
                                       detok_pb2_grpc.add_DetokenizerServicer_to_server, servicer)
    service = await start_grpc_server(ServiceSettings(port=0), [registration])
    channel = open_channel(f"127.0.0.1:{service.port}")
    yield detok_pb2_grpc.DetokenizerStub(channel), servicer.outcomes, engine_address
    await channel.close()
    await service.server.stop(grace=None)
    await engines.close()


_TOOL = st.builds(detok_pb2.ToolSpec, name=st.sampled_from(["", "f", "g"]),
                  parameters_json=PARAMETERS, strict=st.booleans())
_TOOL_CALLS = st.builds(detok_pb2.ToolCallOptions, format=st.integers(0, 5),
                        function_name=st.sampled_from(["", "f"]), max_calls=UINT32,
                        tools=st.lists(_TOOL, max_size=2))
_START = st.builds(lambda tool_calls, **fields: detok_pb2.DetokenizeStart(
    **fields, **({"tool_calls": tool_calls} if tool_calls is not None else {})),
    tool_calls=mostly(None, _TOOL_CALLS), request_id=st.text(PRINTABLE_ASCII, max_size=8),
    stop=st.lists(TEXT, max_size=3), include_stop_str_in_output=st.booleans(),
    skip_special_tokens=st.booleans(), spaces_between_special_tokens=st.booleans())
_GENERATE = st.builds(engine_pb2.GenerateRequest, request_id=st.text(max_size=4),
                      prompt_token_ids=mostly([1, 520], st.lists(IDS, max_size=8)),
                      resume_output_token_ids=mostly([], st.lists(IDS, max_size=4)),
                      n=st.integers(0, 3))
_TEXT_SO_FAR = st.builds(detok_pb2.TextSoFar, num_chars=UINT32,
                         tool_call_argument_chars=st.lists(UINT32, max_size=3))


def _request(engine_address: str, has_engine: bool, text_so_far, **fields):
    request = detok_pb2.TextGenerateRequest(
        engine_address=engine_address if has_engine else "", **fields)
    if text_so_far is not None:
        request.text_so_far.CopyFrom(text_so_far)
    return request


@FUZZ
@given(has_engine=mostly(True, st.just(False)), generate=_GENERATE, detok=_START,
       sample_ids=mostly([], st.lists(st.text(max_size=4), max_size=4)),
       text_so_far=mostly(None, _TEXT_SO_FAR))
async def test_malformed_requests_end_ok_or_invalid_argument(stub, has_engine, generate, detok,
                                                             sample_ids, text_so_far):
    stub, outcomes, engine_address = stub
    call = stub.Generate(_request(engine_address, has_engine, text_so_far, generate=generate,
                                  detok=detok, sample_ids=sample_ids), timeout=20)
    await _read_to_the_end(call)
    code = await call.code()
    server_end = await _last_outcome(outcomes)
    assert server_end in ("OK", "INVALID_ARGUMENT"), server_end
    assert code.name == server_end
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        assert await call.details()
    event(server_end)


async def _last_outcome(outcomes: list, timeout_s: float = 10.0):
    """The server's record of the call just made (it lands as the handler exits)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not outcomes:
        assert loop.time() < deadline, "the server never finished the call"
        await asyncio.sleep(0.005)
    return outcomes.pop()


async def _read_to_the_end(call) -> None:
    """Read every reply (grpc delivers the status only after them)."""
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError:
        pass  # the status says why


@pytest.mark.parametrize("request_id", ["\x1f", "é", "a\nb"])
async def test_a_request_id_that_is_no_metadata_value_is_not_the_engines_failure(
        stub, request_id):
    stub, outcomes, engine_address = stub
    call = stub.Generate(detok_pb2.TextGenerateRequest(
        engine_address=engine_address, generate=engine_pb2.GenerateRequest(prompt_token_ids=[1]),
        detok=detok_pb2.DetokenizeStart(request_id=request_id)), timeout=20)
    await _read_to_the_end(call)
    assert (await call.code()) in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT)
