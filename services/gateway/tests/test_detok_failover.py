"""A choice over two fake detok replicas and a fake engine (real gRPC servers in process):
a generation whose detok replica dies mid-stream resumes on the other with the tokens so
far (the engine continues after them) and the caller gets the exact text once;
TokenizerClient retries a unary call on another replica."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from conveyor.common.grpc_server import ServiceRegistration, start_grpc_server
from conveyor.common.replica_set import ReplicaSet
from conveyor.common.settings import ServiceSettings
from conveyor.gateway.clients.detok import DetokClient, DetokOptions, GenerationDelta
from conveyor.gateway.clients.engine import GenerateJob, SamplingOptions
from conveyor.gateway.clients.tokenizer import TokenizerClient
from conveyor.gateway.clients.upstream import UpstreamError
from conveyor.gateway.generation import ChoiceStream
from conveyor.v1 import detok_pb2_grpc, engine_pb2_grpc, tokenizer_pb2_grpc


def _fakes():
    name = "conveyor_gateway_test_fakes"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("fakes.py"))
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


async def _serve(add_to_server, servicer):
    return await start_grpc_server(ServiceSettings(port=0), [
        ServiceRegistration("replica", add_to_server, servicer)])


@pytest.fixture
async def services():
    """A fake engine and two fake detok replicas."""
    fakes = _fakes()
    engine = fakes.FakeEngine(delay_s=0.02)
    engine_server = await _serve(engine_pb2_grpc.add_EngineServicer_to_server, engine)
    detoks = [fakes.FakeDetok() for _ in range(2)]
    servers = [await _serve(detok_pb2_grpc.add_DetokenizerServicer_to_server, d)
               for d in detoks]
    yield engine, f"127.0.0.1:{engine_server.port}", detoks, servers
    for server in [engine_server, *servers]:
        await server.server.stop(grace=None)


@pytest.fixture
async def tokenizers():
    servers = [await _serve(tokenizer_pb2_grpc.add_TokenizerServicer_to_server,
                            _fakes().FakeTokenizer()) for _ in range(2)]
    yield servers
    for server in servers:
        await server.server.stop(grace=None)


SCRIPT = _fakes().SCRIPT


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


async def _open(services, stop: list[str]) -> tuple[ChoiceStream, DetokClient]:
    _, engine_address, _, servers = services
    detok = DetokClient(ReplicaSet("detok", None, [f"127.0.0.1:{s.port}" for s in servers]))
    job = GenerateJob("r1", ids("hi"), SamplingOptions(max_tokens=30))
    options = DetokOptions("r1", stop=stop)
    source = await detok.generate(engine_address, job, options, [])
    return ChoiceStream(source, ("e", engine_address), detok, job, options), detok


async def _read(choice: ChoiceStream, until=lambda text: False) -> tuple[str, GenerationDelta]:
    text = ""
    while (delta := await choice.next_delta()) is not None:
        text += delta.text
        if until(text) or delta.finish_reason is not None:
            return text, delta
    raise AssertionError("the choice ended without a finish")


@pytest.mark.parametrize("stop", [[], ["friend"]])
async def test_a_generation_whose_detok_replica_dies_resumes_on_the_other(services, stop):
    engine, _, detoks, servers = services
    choice, detok = await _open(services, stop)
    first, _ = await _read(choice, lambda text: text.startswith("Hello"))
    dead = next(i for i, d in enumerate(detoks) if d.requests)  # the replica picked first
    await servers[dead].server.stop(grace=None)
    rest, last = await _read(choice)
    expected = SCRIPT[:30] if not stop else "Hello there, "
    assert first + rest == expected
    assert last.finish_reason == ("length" if not stop else "stop")
    assert last.stop_reason == (None if not stop else "friend")
    assert last.usage.completion_tokens == (30 if not stop else len("Hello there, friend"))
    resumed = detoks[1 - dead].requests[0]
    num_tokens = len(resumed.generate.resume_output_token_ids)
    assert num_tokens >= len(first) and resumed.text_so_far.num_chars == len(first)
    assert list(resumed.generate.resume_output_token_ids) == ids(SCRIPT[:num_tokens])
    assert engine.cancelled == ["r1"]  # the dead replica's engine stream, let go
    await detok.close()


async def test_a_generation_fails_once_every_replica_is_gone(services):
    _, _, _, servers = services
    choice, detok = await _open(services, [])
    await _read(choice, lambda text: text.startswith("Hi") or len(text) > 1)
    for server in servers:
        await server.server.stop(grace=None)
    with pytest.raises(UpstreamError, match="detok: UNAVAILABLE"):
        await _read(choice)
    await choice.close()
    await detok.close()


async def test_tokenizer_calls_move_to_a_live_replica(tokenizers):
    replicas = ReplicaSet("tokenizer", None, [f"127.0.0.1:{s.port}" for s in tokenizers])
    client = TokenizerClient(replicas, rpc_timeout_s=5)
    facts = await client.info()
    await tokenizers[1].server.stop(grace=None)
    assert [await client.info() for _ in range(3)] == [facts] * 3
    assert await client.decode(ids("ok")) == "ok"
    await client.close()
