"""Tool calls survive a detok replica's death: a choice over two real Detokenizer
servicers (real gRPC, the bundled tokenizer) fed by an engine that streams a scripted
text resumes on the second replica when the first stops mid-call, and the caller gets
each call's header once and its arguments exactly, as from a stream that never broke."""

from __future__ import annotations

import asyncio

import pytest

from conveyor.common.grpc_client import Channels
from conveyor.common.grpc_server import ServiceRegistration, start_grpc_server
from conveyor.common.models import load_tokenizer, resolve_model
from conveyor.common.replica_set import ReplicaSet
from conveyor.common.settings import ServiceSettings
from conveyor.detok.server import registration
from conveyor.gateway.clients.detok import (
    DetokClient,
    DetokOptions,
    ToolCallFormat,
    ToolCallParsing,
)
from conveyor.gateway.clients.engine import GenerateJob, SamplingOptions
from conveyor.gateway.generation import ChoiceStream
from conveyor.v1 import engine_pb2, engine_pb2_grpc

TEXT = ('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
        '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET", '
        '"format": "24h"}}\n</tool_call>')


class ScriptedEngine(engine_pb2_grpc.EngineServicer):
    """Streams `token_ids` after the request's resume_output_token_ids, one a chunk,
    `delay_s` apart; `requests` are the requests it got."""

    def __init__(self, token_ids: list[int], delay_s: float = 0.02):
        self.token_ids, self.delay_s, self.requests = token_ids, delay_s, []

    async def Generate(self, request, context):
        self.requests.append(request)
        start = len(request.resume_output_token_ids)
        for i in range(start, len(self.token_ids)):
            await asyncio.sleep(self.delay_s)
            last = i == len(self.token_ids) - 1
            yield engine_pb2.GenerateResponse(
                token_ids=[self.token_ids[i]],
                finish_reason=engine_pb2.FINISH_REASON_STOP if last else 0,
                usage=engine_pb2.Usage(prompt_tokens=1, completion_tokens=i + 1))


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model("smollm2-135m-instruct"))


@pytest.fixture
async def stack(tokenizer):
    """A scripted engine and two detok replicas; yields (engine, its address, detoks)."""
    engine = ScriptedEngine(tokenizer.encode(TEXT))
    engine_server = await start_grpc_server(ServiceSettings(port=0), [ServiceRegistration(
        "conveyor.v1.Engine", engine_pb2_grpc.add_EngineServicer_to_server, engine)])
    channels = Channels()
    detoks = [await start_grpc_server(ServiceSettings(port=0),
                                      [registration(tokenizer, channels)]) for _ in range(2)]
    yield engine, f"127.0.0.1:{engine_server.port}", detoks
    for server in [engine_server, *detoks]:
        await server.server.stop(grace=None)
    await channels.close()


async def _whole(stack, replicas: list, stop_first_when=None) -> tuple[str, dict]:
    """Content and calls ({index: [id, name, arguments]}) of one choice read to its end;
    the replica picked first is stopped once `stop_first_when(content, calls)` says."""
    _, engine_address, _ = stack
    detok = DetokClient(ReplicaSet("detok", None, [f"127.0.0.1:{s.port}" for s in replicas]))
    job = GenerateJob("chatcmpl-x-0", [1], SamplingOptions(max_tokens=500))
    options = DetokOptions("chatcmpl-x-0", tool_calls=ToolCallParsing(ToolCallFormat.HERMES))
    source = await detok.generate(engine_address, job, options, [])
    first = next(s for s in replicas if source.replica.endswith(f":{s.port}"))
    choice = ChoiceStream(source, ("e", engine_address), detok, job, options)
    content, calls = "", {}
    while (delta := await choice.next_delta()) is not None:
        content += delta.text
        for piece in delta.tool_calls:
            if piece.id:
                assert piece.index not in calls, "a call's header came twice"
                calls[piece.index] = [piece.id, piece.name, ""]
            calls[piece.index][2] += piece.arguments
        if stop_first_when is not None and stop_first_when(content, calls):
            stop_first_when = None
            await first.server.stop(grace=None)
    await detok.close()
    return content, calls


async def test_tool_calls_come_once_and_whole_across_a_resumed_stream(stack):
    engine, _, detoks = stack
    expected = await _whole(stack, detoks[1:])
    assert expected[0] == "I will check."
    assert [c[1] for c in expected[1].values()] == ["get_weather", "get_time"]
    assert await _whole(stack, detoks, lambda _, calls: 0 in calls) == expected
    resumed = engine.requests[-1]
    assert len(resumed.resume_output_token_ids) > 0  # the second replica went on after them
