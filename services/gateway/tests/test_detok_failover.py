"""DetokClient over two fake detok replicas (real gRPC servers in process): a stream whose
replica dies mid-generation is rebuilt on the other from the token ids so far, and the
caller gets the exact text once; TokenizerClient retries a unary call on another replica."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from conveyor.common.grpc_server import ServiceRegistration, start_grpc_server
from conveyor.common.replica_set import ReplicaSet
from conveyor.common.settings import ServiceSettings
from conveyor.gateway.text_services import DetokClient, TokenizerClient
from conveyor.gateway.wire import DetokOptions
from conveyor.v1 import detok_pb2_grpc, tokenizer_pb2_grpc


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
async def detoks():
    servers = [await _serve(detok_pb2_grpc.add_DetokenizerServicer_to_server,
                            _fakes().FakeDetok()) for _ in range(2)]
    yield servers
    for server in servers:
        await server.server.stop(grace=None)


@pytest.fixture
async def tokenizers():
    servers = [await _serve(tokenizer_pb2_grpc.add_TokenizerServicer_to_server,
                            _fakes().FakeTokenizer()) for _ in range(2)]
    yield servers
    for server in servers:
        await server.server.stop(grace=None)


def replicas_of(servers) -> ReplicaSet:
    return ReplicaSet("detok", None, [f"127.0.0.1:{s.port}" for s in servers])


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


async def read_until(replies, text: str, got: list[str]) -> None:
    async for reply in replies:
        got.append(reply.text_delta)
        if "".join(got).endswith(text):
            return


@pytest.mark.parametrize("stop", [[], ["friend"]])
async def test_a_stream_whose_replica_dies_is_rebuilt_without_repeating_text(detoks, stop):
    replicas = replicas_of(detoks)
    stream = DetokClient(replicas).open(DetokOptions("r1", stop=stop))
    replies = stream.replies().__aiter__()
    got: list[str] = []
    stream.send_tokens(ids("Hello there"))
    await read_until(replies, "Hello there" if not stop else "Hello ", got)  # "there" held
    await detoks[0].server.stop(grace=None)  # the replica the first pick chose
    stream.send_tokens(ids(", dear friend. Bye"))
    stream.finish()
    async for reply in replies:
        got.append(reply.text_delta)
        last = reply
    expected = "Hello there, dear friend. Bye" if not stop else "Hello there, dear "
    assert "".join(got) == expected
    if stop:
        assert last.stop_match is not None and last.stop_match.stop == "friend"
    assert not stream.send_tokens([1])
    await replicas.close()


async def test_a_stream_fails_once_every_replica_is_gone(detoks):
    replicas = replicas_of(detoks)
    stream = DetokClient(replicas).open(DetokOptions("r2"))
    replies = stream.replies().__aiter__()
    stream.send_tokens(ids("Hi"))
    await read_until(replies, "Hi", [])
    for server in detoks:
        await server.server.stop(grace=None)
    stream.send_tokens(ids("!"))
    with pytest.raises(Exception, match="detok: UNAVAILABLE"):
        async for _ in replies:
            pass
    await replicas.close()


async def test_tokenizer_calls_move_to_a_live_replica(tokenizers):
    replicas = ReplicaSet("tokenizer", None, [f"127.0.0.1:{s.port}" for s in tokenizers])
    client = TokenizerClient(replicas, rpc_timeout_s=5)
    facts = await client.info()
    await tokenizers[1].server.stop(grace=None)
    assert [await client.info() for _ in range(3)] == [facts] * 3
    assert await client.decode(ids("ok")) == "ok"
    await client.close()
