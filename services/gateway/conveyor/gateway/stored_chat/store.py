"""Stored chat completions, per tenant, in Redis.

    {prefix}:chat-completion:{tenant}:{id}   STRING  JSON {"completion": <the ChatCompletion,
                                             with its request's metadata>, "messages":
                                             [<the request's messages>]}
    {prefix}:chat-completions:{tenant}       ZSET    the tenant's ids by the time stored

A completion is written with its request's settlement (`save_call`) and expires `ttl_s`
later; the index is trimmed of expired ids as they are met. The tenant is part of the key:
another tenant's id is not found (404).
"""

from __future__ import annotations

import json
from collections.abc import Callable

from redis.asyncio import Redis

from conveyor.common.redis_scripts import ScriptCall
from conveyor.gateway.errors import APIError
from conveyor.gateway.record_store import RecordStore

_SAVE_LUA = """
local clock = redis.call('TIME')
redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[1])
redis.call('ZADD', KEYS[2], tonumber(clock[1]) + tonumber(clock[2]) / 1e6, ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[1])
return 1
"""
"""Writes a completion (ARGV[3], id ARGV[2]) and indexes it by the time on Redis's clock."""

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
        record = json.dumps({"completion": completion, "messages": messages},
                            separators=(",", ":"))
        return ScriptCall(self._save, [self._key(tenant_id, completion["id"]),
                                       self._index(tenant_id)],
                          [self._ttl_ms, completion["id"], record])

    async def get(self, tenant_id: str, completion_id: str) -> dict:
        """The record ({"completion", "messages"}) of the tenant's completion, else a 404."""
        text = await self._redis.get(self._key(tenant_id, completion_id))
        if text is None:
            raise completion_not_found(completion_id)
        return json.loads(text)

    async def update_metadata(self, tenant_id: str, completion_id: str,
                              metadata: dict[str, str]) -> dict:
        """Replace the completion's metadata (its time to live unchanged); the completion."""
        record = await self.get(tenant_id, completion_id)
        record["completion"]["metadata"] = metadata
        if not await self._redis.set(self._key(tenant_id, completion_id), json.dumps(record),
                                     xx=True, keepttl=True):
            raise completion_not_found(completion_id)  # deleted meanwhile
        return record["completion"]

    async def delete(self, tenant_id: str, completion_id: str) -> None:
        """Forget the tenant's completion; a 404 when there is none."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._key(tenant_id, completion_id))
            pipe.zrem(self._index(tenant_id), completion_id)
            found, _ = await pipe.execute()
        if not found:
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

    async def _completions(self, tenant_id: str, after: str | None, descending: bool):
        """The tenant's stored completions in order, after `after` (a 400 if unknown)."""
        index = self._index(tenant_id)
        start = 0
        if after is not None:
            rank = await (self._redis.zrevrank if descending else self._redis.zrank)(index, after)
            if rank is None:
                raise APIError(400, f"after: no stored chat completion {after!r}",
                               "invalid_request_error", "after")
            start = rank + 1
        read = self._redis.zrevrange if descending else self._redis.zrange
        while ids := await read(index, start, start + _PAGE - 1):
            start += len(ids)
            texts = await self._redis.mget([self._key(tenant_id, i) for i in ids])
            gone = [i for i, text in zip(ids, texts, strict=True) if text is None]
            if gone:
                await self._redis.zrem(index, *gone)
                start -= len(gone)
            for text in texts:
                if text is not None:
                    yield json.loads(text)["completion"]

    def _key(self, tenant_id: str, completion_id: str) -> str:
        return f"{self._prefix}:chat-completion:{{{tenant_id}}}:{completion_id}"

    def _index(self, tenant_id: str) -> str:
        return f"{self._prefix}:chat-completions:{{{tenant_id}}}"
