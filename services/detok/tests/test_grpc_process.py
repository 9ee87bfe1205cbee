"""The detokenizer as a real process over real gRPC, its engine a scripted one in this
process: health, text, stop strings, n samples, errors passed on, cancellation, drain."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest
from detok_scripted_engine import CANCELLED, Failure, Sample, ScriptedEngine
from google.protobuf.message import Message

from conveyor.common.errors import (
    ERROR_REASON_KEY,
    ERROR_SERVICE_KEY,
    INVALID_REQUEST,
    QUEUE_FULL,
)
from conveyor.common.grpc_client import is_serving, open_channel
from conveyor.v1 import detok_pb2, detok_pb2_grpc, engine_pb2
from devkit.service_process import ServiceProcess, without_torch_env

pytestmark = pytest.mark.slow
SERVICE = "conveyor.v1.Detokenizer"
ENV = {**without_torch_env(),  # run as the torch-free container does
       "CONVEYOR_DETOK_PORT": "0", "HF_HUB_OFFLINE": "1", "OTEL_TRACES_EXPORTER": "none"}
STOP, LENGTH = engine_pb2.FINISH_REASON_STOP, engine_pb2.FINISH_REASON_LENGTH
ENGINE_FAILURE = (ERROR_SERVICE_KEY, "engine")


@pytest.fixture(scope="module")
def detok():
    process = ServiceProcess("conveyor.detok", env=ENV).start()
    yield process
    process.stop()


@pytest.fixture
def prompt(tokenizer) -> list[int]:
    return tokenizer.encode("<|im_start|>assistant\n")


def text_request(engine_address: str, prompt: list[int], n: int = 0, logprobs: bool = False,
                 **detok) -> detok_pb2.TextGenerateRequest:
    generate = engine_pb2.GenerateRequest(
        request_id="req-1", prompt_token_ids=prompt, n=n,
        sampling=engine_pb2.SamplingParams(max_tokens=64, logprobs=logprobs))
    return detok_pb2.TextGenerateRequest(
        engine_address=engine_address, generate=generate,
        detok=detok_pb2.DetokenizeStart(request_id="req-1", skip_special_tokens=True, **detok))


async def run_call(address: str, request: detok_pb2.TextGenerateRequest):
    """(responses, None) of a call that ended OK; (responses before it, the error)."""
    channel = open_channel(address)
    responses = []
    try:
        async for response in detok_pb2_grpc.DetokenizerStub(channel).Generate(request,
                                                                                timeout=10):
            responses.append(response)
    except grpc.aio.AioRpcError as error:
        return responses, error
    finally:
        await channel.close()
    return responses, None


async def generate(address: str, request: detok_pb2.TextGenerateRequest):
    responses, error = await run_call(address, request)
    assert error is None, error
    return responses


def text_of(responses) -> str:
    return "".join(r.text_delta for r in responses)


async def test_health_reports_serving(detok):
    channel = open_channel(detok.address)
    assert await is_serving(channel, SERVICE)
    await channel.close()


async def test_stream_emits_text_and_ends_at_a_stop(detok, tokenizer, prompt, serve_engine):
    ids = tokenizer.encode("Hello 😀 world. Bye")  # ". " is complete at " By", the 6th
    engine = ScriptedEngine(Sample(ids, finish_reason=None))
    responses = await generate(detok.address, text_request(
        await serve_engine(engine), prompt, logprobs=True, stop=[". "]))
    assert text_of(responses) == tokenizer.decode(ids).split(". ")[0] == "Hello 😀 world"
    last = responses[-1]
    assert last.finish_reason == STOP and last.stop_string == ". "
    sent = [i for r in responses for i in r.token_ids]
    assert sent == ids[:6] and last.usage.completion_tokens == 6
    assert ([p.logprob for r in responses for p in r.logprobs]
            == pytest.approx([-i / 1000 for i in sent]))
    assert all(r.finish_reason == 0 for r in responses[:-1])
    assert await engine.ended() == CANCELLED  # the stop string cancelled the engine


async def test_finish_flushes_held_text(detok, tokenizer, prompt, serve_engine):
    ids = [*tokenizer.encode("the end"), tokenizer.eos_token_id]
    engine = ScriptedEngine(Sample(ids, finish_reason=STOP))
    responses = await generate(detok.address, text_request(
        await serve_engine(engine), prompt, stop=["the endgame"]))
    # Each chunk answers; all was held as a possible "the endgame" until the finish.
    assert [r.text_delta for r in responses] == ["", "", "the end"]
    assert [r.token_ids for r in responses] == [[i] for i in ids]
    last = responses[-1]
    assert last.finish_reason == STOP and last.WhichOneof("stop_reason") is None
    assert last.usage.completion_tokens == len(ids)


async def test_stop_token_id_and_chunks_pass_through(detok, tokenizer, prompt, serve_engine):
    ids = tokenizer.encode("你好, one two")  # the characters split across tokens and chunks
    engine = ScriptedEngine(Sample(ids, chunk_sizes=(1, 2), finish_reason=STOP,
                                   stop_token_id=ids[-1]))
    responses = await generate(detok.address, text_request(await serve_engine(engine), prompt))
    assert text_of(responses) == tokenizer.decode(ids) == "你好, one two"
    assert [len(r.token_ids) for r in responses] == [1, 2, len(ids) - 3]
    assert responses[-1].stop_token_id == ids[-1]


async def test_n_samples_decode_and_finish_separately(detok, tokenizer, prompt, serve_engine):
    stopped = tokenizer.encode("Yes. It is. Done")  # ". " complete at " It", the 3rd
    plain = tokenizer.encode("No way at all")
    engine = ScriptedEngine(Sample(stopped, chunk_sizes=(2, 2), finish_reason=None),
                            Sample(plain, finish_reason=LENGTH))
    responses = await generate(detok.address, text_request(
        await serve_engine(engine), prompt, n=2, logprobs=True, stop=[". "]))
    first = [r for r in responses if r.index == 0]
    second = [r for r in responses if r.index == 1]
    assert text_of(first) == "Yes" and text_of(second) == tokenizer.decode(plain)
    # sample 0's second chunk (".", " It") completed the match; nothing after it is sent
    assert [list(r.token_ids) for r in first] == [stopped[:2], stopped[2:3]]
    assert [len(r.logprobs) for r in first] == [2, 1]
    assert (first[-1].finish_reason, first[-1].stop_string) == (STOP, ". ")
    assert first[-1].usage.completion_tokens == 3
    assert [i for r in second for i in r.token_ids] == plain
    assert second[-1].finish_reason == LENGTH
    assert second[-1].usage.completion_tokens == len(plain)
    for sample in (first, second):  # each sample's finish on its last response only
        assert [r.finish_reason != 0 for r in sample] == [False] * (len(sample) - 1) + [True]
    assert await engine.ended() == CANCELLED  # both finished: sample 0 streamed no more


async def test_logprobs_come_with_the_texts_of_the_tokens_they_show(detok, tokenizer, prompt,
                                                                    serve_engine):
    ids = tokenizer.encode("Hi 😀. Bye now")  # ". " complete at " By", cut inside a chunk
    engine = ScriptedEngine(Sample(ids, chunk_sizes=(3, 3), finish_reason=None))
    request = text_request(await serve_engine(engine), prompt, logprobs=True, stop=[". "])
    request.generate.sampling.top_logprobs = 2
    request.generate.sampling.prompt_logprobs = 1
    responses = await generate(detok.address, request)
    assert [i for r in responses for i in r.token_ids] == ids[:ids.index(tokenizer.encode(
        " By")[0]) + 1]
    for number, response in enumerate(responses):
        shown = [*response.token_ids, *(t.token_id for p in response.logprobs for t in p.top)]
        if number == 0:  # the prompt's tokens (its special one too) and their alternatives
            shown += [*prompt, *(t.token_id for p in response.prompt_logprobs for t in p.top)]
        assert dict(response.token_texts) == {
            i: tokenizer.decode([i], skip_special_tokens=False) for i in shown}
    assert "<|im_start|>" in responses[0].token_texts.values()
    assert "\ufffd" in "".join(responses[0].token_texts.values())  # half an emoji alone
    plain = await generate(detok.address, text_request(await serve_engine(
        ScriptedEngine(Sample(ids))), prompt))
    assert all(not r.token_texts for r in plain)  # no logprobs, no texts


@pytest.mark.parametrize("failure", [
    Failure(3, grpc.StatusCode.UNAVAILABLE, "engine went away"),
    Failure(0, grpc.StatusCode.RESOURCE_EXHAUSTED, "waiting queue full", QUEUE_FULL),
])
async def test_engine_failure_is_passed_on(detok, tokenizer, prompt, serve_engine, failure):
    ids = tokenizer.encode("one two three four five")
    engine = ScriptedEngine(Sample(ids), fail=failure)
    responses, error = await run_call(detok.address,
                                      text_request(await serve_engine(engine), prompt))
    before = ids[:failure.after_tokens]  # streamed before the failure
    assert [i for r in responses for i in r.token_ids] == before
    assert text_of(responses) == tokenizer.decode(before)
    assert (error.code(), error.details()) == (failure.code, failure.message)
    trailing = tuple(error.trailing_metadata())
    assert ENGINE_FAILURE in trailing
    reasons = [value for key, value in trailing if key == ERROR_REASON_KEY]
    assert reasons == ([failure.reason] if failure.reason else [])


async def test_no_engine_at_the_address_is_the_engines_failure(detok, prompt):
    _, error = await run_call(detok.address, text_request("127.0.0.1:1", prompt))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert ENGINE_FAILURE in tuple(error.trailing_metadata())


async def test_an_id_outside_the_vocabulary_from_the_engine_is_internal(detok, prompt,
                                                                        serve_engine):
    engine = ScriptedEngine(Sample([5, 49152]))
    responses, error = await run_call(detok.address,
                                      text_request(await serve_engine(engine), prompt))
    assert [r.token_ids for r in responses] == [[5]]
    assert error.code() == grpc.StatusCode.INTERNAL
    assert "the engine's output: token_ids[0] = 49152 is outside" in error.details()
    assert ENGINE_FAILURE not in tuple(error.trailing_metadata())


async def test_cancelling_the_call_cancels_the_engines_stream(detok, tokenizer, prompt,
                                                             serve_engine):
    engine = ScriptedEngine(Sample(tokenizer.encode("never ending"), finish_reason=None))
    channel = open_channel(detok.address)
    try:
        call = detok_pb2_grpc.DetokenizerStub(channel).Generate(
            text_request(await serve_engine(engine), prompt), timeout=10)
        assert (await call.read()).text_delta == "never"
        call.cancel()
        assert await engine.ended() == CANCELLED
    finally:
        await channel.close()


def _with(request: detok_pb2.TextGenerateRequest, **changes) -> detok_pb2.TextGenerateRequest:
    """`request` with `changes`: a message field's merged in, another field's set."""
    changed = detok_pb2.TextGenerateRequest()
    changed.CopyFrom(request)
    for name, value in changes.items():
        if isinstance(value, Message):
            getattr(changed, name).MergeFrom(value)
        elif isinstance(value, list):
            getattr(changed, name)[:] = value
        else:
            setattr(changed, name, value)
    return changed


def _tools(*tools: detok_pb2.ToolSpec, **options) -> dict:
    return {"detok": detok_pb2.DetokenizeStart(tool_calls=detok_pb2.ToolCallOptions(
        tools=tools, **options))}


HERMES = {"format": detok_pb2.TOOL_CALL_FORMAT_HERMES}
BAD_REQUESTS = [
    ({"engine_address": ""}, "engine_address is required"),
    ({"detok": detok_pb2.DetokenizeStart(stop=["ok", ""])},
     "stop[1] is empty; stop strings need at least one character"),
    ({"generate": engine_pb2.GenerateRequest(prompt_token_ids=[99999])},
     "prompt_token_ids[4] = 99999 is outside the vocabulary"),
    ({"generate": engine_pb2.GenerateRequest(resume_output_token_ids=[5, 49152])},
     "token_ids[1] = 49152 is outside the vocabulary (ids must be below 49152)"),
    (_tools(format=7), "tool_calls.format 7 is not a known format"),
    (_tools(format=detok_pb2.TOOL_CALL_FORMAT_NAMED),
     "tool_calls.function_name is required with the NAMED format"),
    (_tools(detok_pb2.ToolSpec(name="f", parameters_json="{"), **HERMES),
     "the parameters of tool 'f' are not JSON"),
    (_tools(detok_pb2.ToolSpec(name="f", parameters_json="[]"), **HERMES),
     "the parameters of tool 'f' must be a JSON object"),
    (_tools(detok_pb2.ToolSpec(name="f", parameters_json='{"type": "nonsense"}', strict=True),
            **HERMES), "parameters of tool 'f' are not a valid"),
    ({"generate": engine_pb2.GenerateRequest(n=2), "sample_ids": ["a"]},
     "sample_ids has 1 ids for n = 2 samples"),
    ({"text_so_far": detok_pb2.TextSoFar(num_chars=3)},
     "text_so_far is only for a resumed generation"),
    ({"generate": engine_pb2.GenerateRequest(n=2, resume_output_token_ids=[5])},
     "a resumed generation has one sample (n = 1)"),
]


@pytest.mark.parametrize("changes, message", BAD_REQUESTS)
async def test_bad_requests_are_invalid_argument_and_reach_no_engine(
        detok, tokenizer, prompt, serve_engine, changes, message):
    engine = ScriptedEngine(Sample(tokenizer.encode("unused")))
    request = _with(text_request(await serve_engine(engine), prompt), **changes)
    _, error = await run_call(detok.address, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in error.details()
    assert (ERROR_REASON_KEY, INVALID_REQUEST) in tuple(error.trailing_metadata())
    assert engine.requests == []


async def test_more_samples_than_an_engine_takes_are_refused_before_the_engine(
        detok, tokenizer, prompt, serve_engine):
    engine = ScriptedEngine(Sample(tokenizer.encode("unused")))
    _, error = await run_call(detok.address, text_request(await serve_engine(engine), prompt,
                                                          n=129))
    assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert engine.requests == []


async def test_sigterm_drains_an_in_flight_stream_then_exits(tokenizer, prompt,
                                                             serve_engine):
    ids = tokenizer.encode("still here")
    engine = ScriptedEngine(Sample(ids), hold_after=1)
    process = ServiceProcess("conveyor.detok", env=ENV, name="detok-drain").start()
    channel = open_channel(process.address)
    try:
        call = detok_pb2_grpc.DetokenizerStub(channel).Generate(
            text_request(await serve_engine(engine), prompt), timeout=20)
        assert (await call.read()).text_delta == "still"
        os.kill(process.pid, signal.SIGTERM)
        await _until_new_calls_refused(process.address)
        engine.release.set()
        assert (await call.read()).text_delta == " here"
        assert await call.code() == grpc.StatusCode.OK
        assert _exit_code(process, timeout_s=15) == 0
    finally:
        await channel.close()
        process.kill()


async def _until_new_calls_refused(address: str, timeout_s: float = 15.0) -> None:
    """Until the draining server refuses a new call (it takes the signal on its own time;
    the refusal reads UNAVAILABLE or CANCELLED); before, the call is served:
    INVALID_ARGUMENT, for it names no engine."""
    deadline = time.monotonic() + timeout_s
    while True:
        _, error = await run_call(address, detok_pb2.TextGenerateRequest())
        if error.code() != grpc.StatusCode.INVALID_ARGUMENT:
            return
        assert time.monotonic() < deadline, "new calls were still served after SIGTERM"
        await asyncio.sleep(0.05)


def _exit_code(process: ServiceProcess, timeout_s: float) -> int | None:
    deadline = time.monotonic() + timeout_s
    while process.is_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    return process._proc.poll()
