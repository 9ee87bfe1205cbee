"""The Detokenizer service fuzzed with malformed streams (hypothesis, derandomized): a
stream without `start`, a second `start`, ids at the uint32 edges, empty and huge stop
strings, messages after `finish`. Each call ends OK or with INVALID_ARGUMENT and a
message; never another status, a crash or a hang. In process, real tokenizer."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from conveyor.common.grpc_client import open_channel
from conveyor.common.grpc_server import ServiceRegistration, start_grpc_server
from conveyor.common.settings import ServiceSettings
from conveyor.detok.servicer import DetokenizerServicer
from conveyor.v1 import detok_pb2, detok_pb2_grpc

IDS = st.one_of(st.integers(0, 49151), st.sampled_from([49152, 2**31, 2**32 - 1]))
TEXT = st.one_of(st.text(max_size=6), st.sampled_from(["", "\x00", "💥", "x" * 5_000]))
CLIENT_WRITE_RACE = "Internal error from Core"
"""What grpc's client reports when it wrote a message after the server ended the call."""
FUZZ = settings(max_examples=100, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


class RecordingServicer(DetokenizerServicer):
    """The real servicer, recording how each call ended on the server's side: "OK", the
    code it aborted with, or the exception that escaped it."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.outcomes: list = []

    async def Detokenize(self, request_iterator, context):
        try:
            async for reply in super().Detokenize(request_iterator, context):
                yield reply
        except grpc.aio.AbortError:
            self.outcomes.append(context.code().name)
            raise
        except BaseException as error:
            self.outcomes.append(error)
            raise
        self.outcomes.append("OK")


@pytest.fixture
async def stub(tokenizer):
    servicer = RecordingServicer(tokenizer)
    registration = ServiceRegistration("conveyor.v1.Detokenizer",
                                       detok_pb2_grpc.add_DetokenizerServicer_to_server, servicer)
    service = await start_grpc_server(ServiceSettings(port=0), [registration])
    channel = open_channel(f"127.0.0.1:{service.port}")
    yield detok_pb2_grpc.DetokenizerStub(channel), servicer.outcomes
    await channel.close()
    await service.server.stop(grace=None)


_START = st.builds(detok_pb2.DetokenizeStart, request_id=st.text(max_size=8),
                   prompt_tail_token_ids=st.lists(IDS, max_size=4),
                   stop=st.lists(TEXT, max_size=3), include_stop_str_in_output=st.booleans(),
                   skip_special_tokens=st.booleans(),
                   spaces_between_special_tokens=st.booleans())
_MESSAGE = st.builds(lambda start, ids, finish: detok_pb2.DetokenizeRequest(
    start=start, token_ids=ids, finish=finish),
    st.one_of(st.none(), _START), st.lists(IDS, max_size=6), st.booleans())


@FUZZ
@given(messages=st.lists(_MESSAGE, max_size=4))
async def test_malformed_streams_end_ok_or_invalid_argument(stub, messages):
    stub, outcomes = stub
    call = stub.Detokenize(timeout=20)
    await _send_until_closed(call, messages)
    await _read_to_the_end(call)
    code = await call.code()
    server_end = await _last_outcome(outcomes)
    assert server_end in ("OK", "INVALID_ARGUMENT"), server_end
    if code == grpc.StatusCode.INTERNAL and await call.details() == CLIENT_WRITE_RACE:
        event("client wrote after the server's end")  # grpc's client, not the server
    else:
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
        while await call.read() is not grpc.aio.EOF:
            pass
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
        pass  # the status says why


async def _send_until_closed(call, messages) -> None:
    for message in messages:
        if call.done():
            return
        try:
            await call.write(message)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            return  # the server ended the call (finish, stop match or abort)
    if not call.done():
        await call.done_writing()
