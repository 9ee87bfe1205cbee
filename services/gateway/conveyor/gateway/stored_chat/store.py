"""Stored chat completions, per tenant, in Redis.

    {prefix}:chat-completion:{tenant}:{id}           STRING  JSON: the ChatCompletion, with
                                                     its request's metadata
    {prefix}:chat-completion-messages:{tenant}:{id}  STRING  JSON: the request's messages
    {prefix}:chat-completions:{tenant}               ZSET    the tenant's ids, scored by when
                                                     each was stored (µs, unique)

A completion is written with its request's settlement (`save_call`), both keys expiring
`ttl_s` later; each save also drops from the index the ids stored longer ago than that.
A deleted id stays in the index (lists skip what is gone), so a page's cursor stays valid
until it would have expired anyway. Lists resume after their cursor's score, so what is
saved or deleted meanwhile neither repeats nor hides an item. The tenant is part of the
key: another tenant's id is not found (404).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from redis.asyncio import Redis

from conveyor.common.redis_scripts import ScriptCall
from conveyor.gateway.errors import APIError, bad_request
from conveyor.gateway.record_store import RecordStore

_SAVE_LUA = """
local clock = redis.call('TIME')
local score = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
while #redis.call('ZRANGEBYSCORE', KEYS[3], score, score) > 0 do score = score + 1 end
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', score - tonumber(ARGV[1]) * 1000)
redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[1])
redis.call('SET', KEYS[2], ARGV[4], 'PX', ARGV[1])
redis.call('ZADD', KEYS[3], score, ARGV[2])
redis.call('PEXPIRE', KEYS[3], ARGV[1])
return 1
"""
"""Writes a completion (ARGV[3], id ARGV[2]) and its messages (ARGV[4]), indexed by a
unique score from Redis's clock; drops the ids whose records have expired."""

_PAGE = 100
"""Ids read at a time while a list is filtered."""


def completion_not_found(completion_id: str) -> APIError:
    return APIError(404, f"Chat completion with id '{completion_id}' not found.",
                    "invalid_request_error", "completion_id", "not_found")


class ChatCompletionStore(RecordStore):
    """Writes, reads, lists, changes and deletes stored chat completions (module doc)."""

    def __init__(self, redis: Redis, **options):
        super().__init__(redis, **options)
        self._save = redis.register_script(_SAVE_LUA)

    def save_call(self, tenant_id: str, completion: dict, messages: list[dict]) -> ScriptCall:
        """The write of `completion` and the messages it answered, as a script call to run
        with the settlement."""
        completion_id = completion["id"]
        return ScriptCall(self._save, [*self._keys(tenant_id, completion_id),
                                       self._index(tenant_id)],
                          [self._ttl_ms, completion_id, _json(completion), _json(messages)])

    async def get(self, tenant_id: str, completion_id: str) -> dict:
        """The tenant's completion, else a 404."""
        return json.loads(await self._read(self._keys(tenant_id, completion_id)[0],
                                           completion_id))

    async def messages(self, tenant_id: str, completion_id: str) -> list[dict]:
        """The messages the tenant's completion answered, else a 404."""
        return json.loads(await self._read(self._keys(tenant_id, completion_id)[1],
                                           completion_id))

    async def update_metadata(self, tenant_id: str, completion_id: str,
                              metadata: dict[str, str]) -> dict:
        """Replace the completion's metadata (its time to live unchanged); the completion."""
        completion = await self.get(tenant_id, completion_id) | {"metadata": metadata}
        if not await self._redis.set(self._keys(tenant_id, completion_id)[0],
                                     _json(completion), xx=True, keepttl=True):
            raise completion_not_found(completion_id)  # deleted meanwhile
        return completion

    async def delete(self, tenant_id: str, completion_id: str) -> None:
        """Forget the tenant's completion; a 404 when there is none."""
        if not await self._redis.delete(*self._keys(tenant_id, completion_id)):
            raise completion_not_found(completion_id)

    async def page(self, tenant_id: str, after: str | None, limit: int, descending: bool,
                   wanted: Callable[[dict], bool]) -> tuple[list[dict], bool]:
        """Up to `limit` of the tenant's completions that are `wanted`, oldest first (or
        newest, `descending`), after the one with id `after`; and whether more follow."""
        found: list[dict] = []
        async for completion in self._completions(tenant_id, after, descending):
            if wanted(completion):
                if len(found) == limit:
                    return found, True
                found.append(completion)
        return found, False

    async def _completions(self, tenant_id: str, after: str | None,
                           descending: bool) -> AsyncIterator[dict]:
        """The tenant's stored completions in order, after `after` (a 400 if unknown)."""
        index = self._index(tenant_id)
        bound = "+inf" if descending else "-inf"
        if after is not None:
            score = await self._redis.zscore(index, after)
            if score is None:
                raise bad_request(f"after: no stored chat completion {after!r}", "after")
            bound = f"({int(score)}"
        end = "-inf" if descending else "+inf"
        read = self._redis.zrevrangebyscore if descending else self._redis.zrangebyscore
        while entries := await read(index, bound, end, start=0, num=_PAGE, withscores=True):
            bound = f"({int(entries[-1][1])}"
            texts = await self._redis.mget([self._keys(tenant_id, i)[0] for i, _ in entries])
            for text in texts:
                if text is not None:  # deleted, or expired and not yet trimmed
                    yield json.loads(text)

    async def _read(self, key: str, completion_id: str) -> str:
        text = await self._redis.get(key)
        if text is None:
            raise completion_not_found(completion_id)
        return text

    def _keys(self, tenant_id: str, completion_id: str) -> list[str]:
        return [f"{self._prefix}:chat-completion:{{{tenant_id}}}:{completion_id}",
                f"{self._prefix}:chat-completion-messages:{{{tenant_id}}}:{completion_id}"]

    def _index(self, tenant_id: str) -> str:
        return f"{self._prefix}:chat-completions:{{{tenant_id}}}"


def _json(value) -> str:
    return json.dumps(value, separators=(",", ":"))
