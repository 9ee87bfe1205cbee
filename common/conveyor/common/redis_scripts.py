"""Several Lua scripts in one Redis round trip.

redis-py runs a registered script with EVALSHA, loading it on NOSCRIPT: one round trip
alone. Queued in a pipeline, though, its scripts cost an extra SCRIPT EXISTS round
trip before the pipeline is sent. `run_script_calls` sends them as one plain
pipeline of EVALSHAs instead (not a transaction: their keys may lie in different
Redis Cluster slots), and only a script Redis no longer holds (it restarted, or its
scripts were flushed) is loaded and its call run again; NOSCRIPT means it did not run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, ResponseError


@dataclass(slots=True, frozen=True)
class ScriptCall:
    """One run of a registered script: what `script(keys=..., args=...)` would send."""

    script: AsyncScript
    keys: Sequence[str]
    args: Sequence[Any]


async def run_script_calls(redis: Redis, calls: Sequence[ScriptCall]) -> list[Any]:
    """Run `calls` in one round trip; their replies in order. The first error a call
    returned is raised after all of them ran (each script is atomic on its own)."""
    if not calls:
        return []
    async with redis.pipeline(transaction=False) as pipe:
        for call in calls:
            pipe.evalsha(call.script.sha, len(call.keys), *call.keys, *call.args)
        replies = await pipe.execute(raise_on_error=False)
    for index, (call, reply) in enumerate(zip(calls, replies, strict=True)):
        if isinstance(reply, NoScriptError):
            try:
                replies[index] = await call.script(keys=list(call.keys), args=list(call.args))
            except ResponseError as error:  # raised below, once the others ran
                replies[index] = error
    error = next((reply for reply in replies if isinstance(reply, Exception)), None)
    if error is not None:
        raise error
    return replies
