"""A constrained request in the engine core: it waits for its grammar while others run, leaves
nothing behind when cancelled meanwhile, fails as the caller's fault when its grammar does not
compile (or not in time), and each of its samples follows a matcher of its own."""

from __future__ import annotations

import time
from concurrent.futures import Future

import grpc
import pytest

from conveyor.common.errors import ERROR_REASON_KEY, INVALID_REQUEST
from conveyor.engine import SamplingParams, StructuredOutputsParams
from conveyor.engine.core.request import FinishReason
from conveyor.engine.engine_request import EngineRequest
from conveyor.v1 import engine_pb2

ANY_DIGITS = StructuredOutputsParams(regex="[0-9]*")


class GatedCompiler:
    """A real compiler whose grammars are handed out only when the test opens the gate:
    a compile that takes as long as the test wants."""

    def __init__(self, compiler) -> None:
        self.compiler = compiler
        self.pending: list[tuple[Future, StructuredOutputsParams]] = []

    def compile(self, params: StructuredOutputsParams) -> Future:
        future = Future()
        self.pending.append((future, params))
        return future

    def open(self) -> None:
        for future, params in self.pending:
            future.set_result(self.compiler.compile(params).result())

    def close(self) -> None:
        self.compiler.close()


@pytest.fixture
def grammars(support, make_tiny_compiler):
    return make_tiny_compiler(support.GRAMMAR_TOKENS, support.EOS)


def constrained(request_id: str, constraint=ANY_DIGITS, prompt=(1, 2, 3), **params):
    params.setdefault("max_tokens", 4)
    return EngineRequest(request_id, list(prompt), SamplingParams(
        temperature=0.0, structured_outputs=constraint, **params))


def free(request_id: str, prompt=(40, 41, 42), max_tokens: int = 4) -> EngineRequest:
    return EngineRequest(request_id, list(prompt), SamplingParams(temperature=0.0,
                                                                  max_tokens=max_tokens))


def assert_nothing_left(core) -> None:
    stats = core.stats()
    assert not core.has_unfinished_requests and not core.scheduler.requests
    assert stats.num_waiting == 0 and stats.num_free_blocks == stats.num_blocks
    assert not core._awaiting_grammar and core._num_held_siblings == 0


def test_a_request_waits_for_its_grammar_while_others_run(support, grammars):
    gated = GatedCompiler(grammars)
    core = support.make_core(grammars=gated)
    core.add_request(constrained("slow"))
    core.add_request(free("other"))
    tokens: dict[str, list[int]] = {"slow": [], "other": []}
    for _ in range(3):
        for delta in core.step():
            tokens[delta.request_id] += delta.new_token_ids
    assert tokens == {"slow": [], "other": [43, 44, 45]}
    assert core.stats().num_waiting == 1

    gated.open()
    for delta in support.run_to_completion(core):
        tokens[delta.request_id] += delta.new_token_ids
    assert tokens["slow"] == [4, 5, 6, 7]
    assert_nothing_left(core)


def test_cancel_while_waiting_for_the_grammar_leaves_nothing_behind(support, grammars):
    gated = GatedCompiler(grammars)
    core = support.make_core(grammars=gated)
    core.add_request(constrained("slow", n=3))
    core.add_request(free("other", max_tokens=2))
    core.step()
    core.abort(["slow"])
    support.run_to_completion(core)
    gated.open()  # the compile ends after its request left: nothing is waiting for it
    assert not core.step()
    assert_nothing_left(core)


@pytest.mark.parametrize(("constraint", "message"), [
    (StructuredOutputsParams(regex="[0-9"), "structured output regex does not compile"),
    (StructuredOutputsParams(json='{"type": "frog"}'), "structured output json does not compile"),
])
def test_a_grammar_that_does_not_compile_fails_every_sample_as_invalid(
        support, grammars, constraint, message):
    core = support.make_core(grammars=grammars)
    core.add_request(constrained("bad", constraint, n=2))
    deltas = []
    deadline = time.monotonic() + 10
    while core.has_unfinished_requests and time.monotonic() < deadline:
        deltas += core.step()
    [delta] = deltas
    assert delta.request_id == "bad" and delta.finish_reason is FinishReason.ABORT
    assert delta.invalid_request and message in delta.error and not delta.new_token_ids
    assert_nothing_left(core)


def test_a_grammar_past_the_compile_timeout_fails_the_request(support, grammars):
    core = support.make_core(grammars=GatedCompiler(grammars), grammar_compile_timeout_s=0.05)
    core.add_request(constrained("slow"))
    deltas = []
    deadline = time.monotonic() + 10
    while not deltas and time.monotonic() < deadline:
        deltas = core.step()
    [delta] = deltas
    assert delta.invalid_request
    assert "did not compile within 0.05 s (CONVEYOR_ENGINE_GRAMMAR_COMPILE_TIMEOUT_S)" \
        in delta.error
    assert_nothing_left(core)


def test_each_sample_gets_a_matcher_of_its_own(support, grammars):
    grammars.compile(ANY_DIGITS).result()  # cached: the grammar starts at the next step
    core = support.make_core(grammars=grammars)
    core.add_request(constrained("n", n=3, max_tokens=6))
    matchers = set()
    for _ in range(20):
        core.step()
        matchers |= {id(r.grammar.matcher) for r in core.scheduler.requests.values()
                     if r.grammar.is_started}
    assert len(matchers) == 3
    assert not core.has_unfinished_requests


def test_a_resumed_request_whose_output_breaks_the_grammar_is_refused(support, grammars):
    constraint = StructuredOutputsParams(regex="(04)+")
    grammars.compile(constraint).result()
    core = support.make_core(grammars=grammars)
    request = constrained("resumed", constraint)
    request.output_token_ids = [4, 7]
    core.add_request(request)
    [delta] = core.step()
    assert delta.invalid_request and "resume_output_token_ids do not follow" in delta.error
    assert_nothing_left(core)


async def test_a_bad_regex_is_invalid_argument_with_the_librarys_message(support, grammars):
    core = support.make_core(grammars=grammars)
    async with support.serve_engine(core) as (engine, stub):
        request = engine_pb2.GenerateRequest(
            request_id="bad", prompt_token_ids=[1, 2], sampling=engine_pb2.SamplingParams(
                max_tokens=4), structured_output=engine_pb2.StructuredOutput(regex="(ab"))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in stub.Generate(request):
                pass
    error = caught.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "structured output regex does not compile" in error.details()
    assert "unclosed group" in error.details()  # the library's own words
    assert (ERROR_REASON_KEY, INVALID_REQUEST) in tuple(error.trailing_metadata())
    assert engine.num_streams == 0
    assert_nothing_left(core)


@pytest.mark.parametrize(("proto", "expected"), [
    (engine_pb2.StructuredOutput(json_schema='{"type": "object"}'),
     StructuredOutputsParams(json='{"type": "object"}')),
    (engine_pb2.StructuredOutput(json_object=True), StructuredOutputsParams(json_object=True)),
    (engine_pb2.StructuredOutput(regex="[0-9]+"), StructuredOutputsParams(regex="[0-9]+")),
    (engine_pb2.StructuredOutput(choice=engine_pb2.StringChoice(options=["a", "b"])),
     StructuredOutputsParams(choice=["a", "b"])),
    (engine_pb2.StructuredOutput(grammar="start: /a+/"),
     StructuredOutputsParams(grammar="start: /a+/")),
    (None, None),
])
def test_the_servicer_maps_each_kind_of_the_proto_field(proto, expected):
    from conveyor.engine.servicer import to_structured_outputs

    request = engine_pb2.GenerateRequest(prompt_token_ids=[1])
    if proto is not None:
        request.structured_output.CopyFrom(proto)
    assert to_structured_outputs(request) == expected


@pytest.mark.parametrize(("proto", "message"), [
    (engine_pb2.StructuredOutput(), "structured_output has no kind set"),
    (engine_pb2.StructuredOutput(json_object=False), "json_object must be true"),
    (engine_pb2.StructuredOutput(choice=engine_pb2.StringChoice()), "at least one option"),
])
def test_the_servicer_refuses_a_constraint_without_meaning(proto, message):
    from conveyor.engine.sampling_params import InvalidSamplingParams
    from conveyor.engine.servicer import to_structured_outputs

    request = engine_pb2.GenerateRequest(prompt_token_ids=[1], structured_output=proto)
    with pytest.raises(InvalidSamplingParams, match=message):
        to_structured_outputs(request)


async def test_a_stream_cancelled_while_its_grammar_compiles_leaves_nothing(support, grammars):
    import asyncio

    gated = GatedCompiler(grammars)
    core = support.make_core(grammars=gated)
    async with support.serve_engine(core) as (engine, stub):
        call = stub.Generate(engine_pb2.GenerateRequest(
            request_id="slow", prompt_token_ids=[1, 2], n=2,
            sampling=engine_pb2.SamplingParams(max_tokens=4),
            structured_output=engine_pb2.StructuredOutput(regex="[0-9]*")))
        reader = asyncio.ensure_future(call.read())
        await _until(lambda: engine.stats().num_waiting == 2)  # two samples, neither running
        call.cancel()
        await _until(lambda: engine.num_streams == 0 and engine.stats().num_waiting == 0)
        reader.cancel()
        gated.open()  # the compile finishes after its request left
        await _until(lambda: not core.has_unfinished_requests)
        stats = engine.stats()
        assert stats.num_running == 0 and stats.num_free_blocks == stats.num_blocks
        assert not core._awaiting_grammar


async def _until(condition, timeout_s: float = 10.0) -> None:
    import asyncio

    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)
