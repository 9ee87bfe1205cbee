"""The detokenizer as a real process over real gRPC: health, streams, errors, drain."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest

from conveyor.common.errors import ERROR_REASON_KEY, INVALID_REQUEST
from conveyor.common.grpc_client import is_serving, open_channel
from conveyor.common.testing import ServiceProcess, without_torch_env
from conveyor.v1 import detok_pb2, detok_pb2_grpc

pytestmark = pytest.mark.slow
SERVICE = "conveyor.v1.Detokenizer"
ENV = {**without_torch_env(),  # run as the torch-free container does
       "CONVEYOR_DETOK_PORT": "0", "HF_HUB_OFFLINE": "1", "OTEL_TRACES_EXPORTER": "none"}


@pytest.fixture(scope="module")
def detok():
    process = ServiceProcess("conveyor.detok", env=ENV).start()
    yield process
    process.stop()


def start_message(**fields) -> detok_pb2.DetokenizeRequest:
    return detok_pb2.DetokenizeRequest(start=detok_pb2.DetokenizeStart(**fields))


async def run_stream(address: str, messages: list[detok_pb2.DetokenizeRequest]):
    channel = open_channel(address)
    try:
        stub = detok_pb2_grpc.DetokenizerStub(channel)
        return [reply async for reply in stub.Detokenize(iter(messages), timeout=10)]
    finally:
        await channel.close()


async def test_health_reports_serving(detok):
    channel = open_channel(detok.address)
    assert await is_serving(channel, SERVICE)
    await channel.close()


async def test_stream_emits_text_and_ends_at_a_stop(detok, tokenizer):
    ids = tokenizer.encode("Hello 😀 world. Bye")
    replies = await run_stream(detok.address, [
        start_message(stop=[". "], skip_special_tokens=True),
        *[detok_pb2.DetokenizeRequest(token_ids=[i]) for i in ids],
    ])
    assert "".join(r.text_delta for r in replies) == "Hello 😀 world"
    last = replies[-1]
    assert last.stop_match.stop == ". " and last.stop_match.stop_index == 0
    assert last.stop_match.num_tokens == last.num_tokens < len(ids)


async def test_finish_flushes_held_text_and_ends_the_stream(detok, tokenizer):
    prompt = tokenizer.encode("<|im_start|>assistant\n")
    ids = [*tokenizer.encode("the end"), 2]
    replies = await run_stream(detok.address, [
        start_message(prompt_tail_token_ids=prompt, stop=["the endgame"], skip_special_tokens=True),
        detok_pb2.DetokenizeRequest(token_ids=ids),
        detok_pb2.DetokenizeRequest(finish=True),
    ])
    # Everything was held as a possible "the endgame" until finish; empty answers are not sent.
    assert [r.text_delta for r in replies] == ["the end"]
    assert not replies[0].HasField("stop_match") and replies[0].num_tokens == len(ids)


async def test_start_with_tokens_and_finish_in_one_message(detok, tokenizer):
    ids = tokenizer.encode("你好")
    replies = await run_stream(detok.address, [
        detok_pb2.DetokenizeRequest(
            start=detok_pb2.DetokenizeStart(skip_special_tokens=True), token_ids=ids, finish=True)
    ])
    assert "".join(r.text_delta for r in replies) == "你好"


BAD_STREAMS = [
    ([detok_pb2.DetokenizeRequest(token_ids=[5])],
     "the first Detokenize message must carry `start`"),
    ([start_message(), start_message()], "`start` may only be set on the first message"),
    ([start_message(), detok_pb2.DetokenizeRequest(token_ids=[5, 49152])],
     "token_ids[1] = 49152 is outside the vocabulary (ids must be below 49152)"),
    ([start_message(prompt_tail_token_ids=[99999])],
     "prompt_tail_token_ids[0] = 99999 is outside the vocabulary"),
    ([start_message(stop=[""])], "stop[0] is empty; stop strings need at least one character"),
]


@pytest.mark.parametrize("messages, message", BAD_STREAMS)
async def test_bad_streams_are_invalid_argument(detok, messages, message):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await run_stream(detok.address, messages)
    error = caught.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in error.details()
    assert (ERROR_REASON_KEY, INVALID_REQUEST) in tuple(error.trailing_metadata())


async def test_sigterm_drains_an_in_flight_stream_then_exits(tokenizer):
    process = ServiceProcess("conveyor.detok", env=ENV, name="detok-drain").start()
    channel = open_channel(process.address)
    try:
        call = detok_pb2_grpc.DetokenizerStub(channel).Detokenize(timeout=20)
        await call.write(start_message(skip_special_tokens=True))
        await call.write(detok_pb2.DetokenizeRequest(token_ids=tokenizer.encode("still")))
        assert (await call.read()).text_delta == "still"
        os.kill(process.pid, signal.SIGTERM)
        await _until_new_calls_refused(process.address)
        await call.write(detok_pb2.DetokenizeRequest(token_ids=tokenizer.encode(" here"),
                                                     finish=True))
        assert (await call.read()).text_delta == " here"
        assert await call.code() == grpc.StatusCode.OK
        assert _exit_code(process, timeout_s=15) == 0
    finally:
        await channel.close()
        process.kill()


async def _until_new_calls_refused(address: str, timeout_s: float = 15.0) -> None:
    """Until the draining server refuses a new call (it takes the signal on its own time)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await run_stream(address, [start_message(), detok_pb2.DetokenizeRequest(finish=True)])
        except grpc.aio.AioRpcError:
            return
        assert time.monotonic() < deadline, "new calls were still served after SIGTERM"
        await asyncio.sleep(0.05)


def _exit_code(process: ServiceProcess, timeout_s: float) -> int | None:
    deadline = time.monotonic() + timeout_s
    while process.is_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    return process._proc.poll()
