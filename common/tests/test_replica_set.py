"""ReplicaSet over the real Redis registry and real in-process gRPC servers: calls
spread round robin, reach a replica that registers, move off one that leaves or
dies, and fail over only on errors that mean "this replica did not answer"."""

from __future__ import annotations

import asyncio
import collections

import grpc
import pytest

from conveyor.common.grpc_server import ServiceRegistration, start_grpc_server
from conveyor.common.replica_set import ReplicaSet
from conveyor.common.service_registry import ReplicaEntry, ServiceRegistry
from conveyor.common.settings import ServiceSettings
from conveyor.v1 import tokenizer_pb2, tokenizer_pb2_grpc

REFRESH_S = 0.1


class NamedTokenizer(tokenizer_pb2_grpc.TokenizerServicer):
    """Info answers with the replica's name; Decode always refuses its input."""

    def __init__(self, name: str):
        self.name = name

    async def Info(self, request, context):
        return tokenizer_pb2.TokenizerInfo(model=self.name)

    async def Decode(self, request, context):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad ids")


async def start_replica(name: str):
    servicer = NamedTokenizer(name)
    return await start_grpc_server(ServiceSettings(port=0), [ServiceRegistration(
        "conveyor.v1.Tokenizer", tokenizer_pb2_grpc.add_TokenizerServicer_to_server, servicer)])


def address(server) -> str:
    return f"127.0.0.1:{server.port}"


async def info_from(replicas: ReplicaSet) -> str:
    async def info(channel):
        return await tokenizer_pb2_grpc.TokenizerStub(channel).Info(
            tokenizer_pb2.TokenizerInfoRequest(), timeout=5)
    return (await replicas.call(info)).model


async def wait_until(condition, timeout_s: float = 10.0):
    """Await `condition()` until it is true or the deadline passes (then fail)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


@pytest.fixture
async def servers():
    started = {name: await start_replica(name) for name in ("a", "b", "c")}
    yield started
    for server in started.values():
        await server.server.stop(grace=None)


@pytest.fixture
def registry(redis, prefix):
    return ServiceRegistry(redis, service="tokenizer", entry_type=ReplicaEntry, prefix=prefix)


@pytest.fixture
async def replica_set(registry):
    replicas = ReplicaSet("tokenizer", registry, ["127.0.0.1:1"], refresh_s=REFRESH_S)
    yield replicas
    await replicas.close()


async def register(registry, server) -> None:
    await registry.heartbeat(ReplicaEntry(address(server), "m"))


async def test_calls_spread_round_robin_and_reach_a_replica_registered_mid_run(
        servers, registry, replica_set):
    await register(registry, servers["a"])
    await register(registry, servers["b"])
    counts = collections.Counter([await info_from(replica_set) for _ in range(6)])
    assert counts == {"a": 3, "b": 3}

    await register(registry, servers["c"])

    async def c_gets_calls():
        return await info_from(replica_set) == "c"
    await wait_until(c_gets_calls)


async def test_a_replica_that_deregisters_gets_no_new_calls(servers, registry, replica_set):
    for name in ("a", "b"):
        await register(registry, servers[name])
    assert {await info_from(replica_set) for _ in range(2)} == {"a", "b"}
    await registry.deregister(address(servers["a"]))

    async def only_b():
        return {await info_from(replica_set) for _ in range(4)} == {"b"}
    await wait_until(only_b)


async def test_a_dead_replica_fails_over_and_is_left_out(servers, registry, replica_set):
    for name in ("a", "b"):
        await register(registry, servers[name])
    await servers["a"].server.stop(grace=None)
    # Still registered (its entry has not expired), but every call succeeds on b.
    assert [await info_from(replica_set) for _ in range(4)] == ["b"] * 4
    assert address(servers["a"]) in await replica_set.live_addresses()


async def test_static_addresses_stand_in_while_none_registered(servers, registry):
    replicas = ReplicaSet("tokenizer", registry, [address(servers["c"])], refresh_s=REFRESH_S)
    try:
        assert await info_from(replicas) == "c"
        await register(registry, servers["a"])

        async def registered_wins():
            return await info_from(replicas) == "a"
        await wait_until(registered_wins)
    finally:
        await replicas.close()


async def test_errors_of_the_request_are_not_retried(servers, registry, replica_set):
    for name in ("a", "b"):
        await register(registry, servers[name])
    calls = []

    async def decode(channel):
        calls.append(channel)
        return await tokenizer_pb2_grpc.TokenizerStub(channel).Decode(
            tokenizer_pb2.DecodeRequest(), timeout=5)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await replica_set.call(decode)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT and len(calls) == 1


async def test_no_live_replica_is_unavailable(registry):
    replicas = ReplicaSet("tokenizer", registry, ["127.0.0.1:1"], refresh_s=REFRESH_S)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await info_from(replicas)
        assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
    finally:
        await replicas.close()


async def test_the_channel_of_a_replica_that_left_is_closed_after_its_retirement(
        servers, registry):
    replicas = ReplicaSet("tokenizer", registry, [], refresh_s=REFRESH_S, retire_after_s=0.3)
    try:
        for name in ("a", "b"):
            await register(registry, servers[name])
        assert {await info_from(replicas) for _ in range(2)} == {"a", "b"}
        await registry.deregister(address(servers["a"]))

        async def only_b_open():
            return replicas.open_addresses == {address(servers["b"])}
        await wait_until(only_b_open)
    finally:
        await replicas.close()
