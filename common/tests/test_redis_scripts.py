"""Several scripts in one round trip against the real Redis, NOSCRIPT recovered."""

from __future__ import annotations

import uuid

import pytest
import redis.asyncio.connection as redis_connection
from redis.exceptions import ResponseError

from conveyor.common.redis_scripts import ScriptCall, run_script_calls

ECHO = "redis.call('SET', KEYS[1], ARGV[1]) return ARGV[1] .. '{tag}'"


@pytest.fixture
def sends(monkeypatch) -> list:
    """Every write of commands to a Redis socket."""
    sent, send = [], redis_connection.AbstractConnection.send_packed_command

    async def counted(connection, command, check_health=True):
        sent.append(command)
        return await send(connection, command, check_health)

    monkeypatch.setattr(redis_connection.AbstractConnection, "send_packed_command", counted)
    return sent


async def test_loaded_scripts_run_in_one_round_trip(redis, prefix, sends):
    echo = redis.register_script(ECHO.format(tag=""))
    await echo(keys=[f"{prefix}:warm"], args=["x"])  # loaded now
    sends.clear()
    replies = await run_script_calls(redis, [ScriptCall(echo, [f"{prefix}:{i}"], [str(i)])
                                             for i in range(3)])
    assert replies == ["0", "1", "2"] and len(sends) == 1
    assert await redis.get(f"{prefix}:2") == "2"


async def test_a_script_redis_does_not_hold_is_loaded_and_run_once(redis, prefix):
    fresh = redis.register_script(ECHO.format(tag=uuid.uuid4().hex))  # never loaded
    known = redis.register_script(ECHO.format(tag=""))
    await known(keys=[f"{prefix}:warm"], args=["x"])
    replies = await run_script_calls(redis, [ScriptCall(known, [f"{prefix}:a"], ["a"]),
                                             ScriptCall(fresh, [f"{prefix}:b"], ["b"])])
    assert replies[0] == "a" and replies[1].startswith("b")
    assert await redis.mget(f"{prefix}:a", f"{prefix}:b") == ["a", "b"]


async def test_an_error_is_raised_after_every_call_ran(redis, prefix):
    failing = redis.register_script(f"return redis.error_reply('refused {uuid.uuid4().hex}')")
    echo = redis.register_script(ECHO.format(tag=uuid.uuid4().hex))  # neither loaded yet
    with pytest.raises(ResponseError, match="refused"):
        await run_script_calls(redis, [ScriptCall(failing, [f"{prefix}:x"], []),
                                       ScriptCall(echo, [f"{prefix}:after"], ["ran"])])
    assert await redis.get(f"{prefix}:after") == "ran"


async def test_no_calls_no_round_trip(redis, sends):
    assert await run_script_calls(redis, []) == [] and sends == []
