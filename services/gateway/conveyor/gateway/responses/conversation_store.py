"""Conversations (the Conversations API), per tenant, in Redis.

    {prefix}:conversation:{tenant}:{id}         STRING  JSON {"id", "created_at", "metadata"}
    {prefix}:conversation-items:{tenant}:{id}   LIST    its items (JSON), oldest first

Items are added only to a conversation that exists (a script checks), so a DELETE that
comes first is never undone by a response finishing later. Both keys expire `ttl_s` after
the conversation last changed (created, updated, items added or deleted). The tenant is
part of the key: another tenant's id is not found (404).
"""

from __future__ import annotations

import json
import time
import uuid

from redis.asyncio import Redis

from conveyor.common.redis_scripts import ScriptCall
from conveyor.gateway.errors import APIError, bad_request
from conveyor.gateway.record_store import RecordStore
from conveyor.gateway.responses.items import repeated_id

_ADD_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if KEYS[3] and (redis.call('EXISTS', KEYS[3]) == 1 or redis.call('EXISTS', KEYS[4]) == 0) then
  return 0
end
local seen = {}
for _, item in ipairs(redis.call('LRANGE', KEYS[2], 0, -1)) do
  seen[cjson.decode(item)['id']] = true
end
for i = 2, #ARGV do
  local id = cjson.decode(ARGV[i])['id']
  if seen[id] then return id end
  seen[id] = true
end
for i = 2, #ARGV do redis.call('RPUSH', KEYS[2], ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[2], ARGV[1])
return 1
"""
"""Appends items (ARGV[2..]) to an existing conversation: 1; 0 when there is none, or when
the background response adding them was not saved (KEYS[3], KEYS[4]: its run still there,
or its record gone; the save runs just before in the same round trip and is refused for a
run cancelled, failed, deleted or whose lease ran out); an item id already in the
conversation (or twice in ARGV): that id, and nothing added."""

_DELETE_ITEM_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
for _, item in ipairs(redis.call('LRANGE', KEYS[2], 0, -1)) do
  if cjson.decode(item)['id'] == ARGV[2] then
    redis.call('LREM', KEYS[2], 1, item)
    redis.call('PEXPIRE', KEYS[1], ARGV[1])
    redis.call('PEXPIRE', KEYS[2], ARGV[1])
    return 1
  end
end
return 0
"""
"""Removes the item with id ARGV[2]: 1, 0 when the conversation has none, -1 when there is
no conversation."""


def conversation_not_found(conversation_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"Conversation with id '{conversation_id}' not found.",
                    "invalid_request_error", param, "conversation_not_found")


def duplicate_item(item_id: str, param: str) -> APIError:
    return bad_request(f"Duplicate item found with id '{item_id}'.", param)


def item_not_found(item_id: str) -> APIError:
    return APIError(404, f"Item with id '{item_id}' not found.", "invalid_request_error",
                    "item_id", "item_not_found")


class ConversationStore(RecordStore):
    """Creates, reads, changes and deletes conversations and their items (see the module doc)."""

    def __init__(self, redis: Redis, **options):
        super().__init__(redis, **options)
        self._add = redis.register_script(_ADD_LUA)
        self._delete_item = redis.register_script(_DELETE_ITEM_LUA)

    async def create(self, tenant_id: str, metadata: dict[str, str],
                     items: list[dict]) -> dict:
        """A new conversation with `items`: its Conversation object (a 400 naming `items`
        when an id is repeated)."""
        if (repeated := repeated_id(items)) is not None:
            raise duplicate_item(repeated, "items")
        conversation = {"id": f"conv_{uuid.uuid4().hex}", "object": "conversation",
                        "created_at": int(time.time()), "metadata": metadata}
        keys = self._keys(tenant_id, conversation["id"])
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(keys[0], json.dumps(conversation), px=self._ttl_ms)
            if items:
                pipe.rpush(keys[1], *map(json.dumps, items))
                pipe.pexpire(keys[1], self._ttl_ms)
            await pipe.execute()
        return conversation

    async def get(self, tenant_id: str, conversation_id: str,
                  param: str | None = None) -> dict:
        """The tenant's conversation, else a 404 (naming `param`)."""
        text = await self._redis.get(self._keys(tenant_id, conversation_id)[0])
        if text is None:
            raise conversation_not_found(conversation_id, param)
        return json.loads(text)

    async def update(self, tenant_id: str, conversation_id: str,
                     metadata: dict[str, str]) -> dict:
        """Replace the conversation's metadata; the conversation afterwards."""
        conversation = await self.get(tenant_id, conversation_id) | {"metadata": metadata}
        keys = self._keys(tenant_id, conversation_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(keys[0], json.dumps(conversation), px=self._ttl_ms, xx=True)
            pipe.pexpire(keys[1], self._ttl_ms)
            written, _ = await pipe.execute()
        if not written:  # deleted meanwhile
            raise conversation_not_found(conversation_id)
        return conversation

    async def delete(self, tenant_id: str, conversation_id: str) -> None:
        """Forget the conversation and its items; a 404 when there is none."""
        keys = self._keys(tenant_id, conversation_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(keys[0])
            pipe.delete(keys[1])
            found, _ = await pipe.execute()
        if not found:
            raise conversation_not_found(conversation_id)

    def add_call(self, tenant_id: str, conversation_id: str, items: list[dict],
                 saved_keys: list[str] | None = None) -> ScriptCall:
        """Appending `items` (see _ADD_LUA; `saved_keys`: a background response's, from
        ResponseStore.saved_keys), as a script call to run with a response's settlement."""
        keys = [*self._keys(tenant_id, conversation_id), *(saved_keys or [])]
        return ScriptCall(self._add, keys, [self._ttl_ms, *map(json.dumps, items)])

    async def add(self, tenant_id: str, conversation_id: str, items: list[dict]) -> None:
        """Append `items`; a 404 when there is no such conversation, a 400 naming `items`
        when one's id is taken."""
        call = self.add_call(tenant_id, conversation_id, items)
        added = await call.script(keys=call.keys, args=call.args)
        if added == 0:
            raise conversation_not_found(conversation_id)
        if added != 1:
            raise duplicate_item(added, "items")

    async def items(self, tenant_id: str, conversation_id: str,
                    param: str | None = None) -> list[dict]:
        """Every item of the tenant's conversation, oldest first; a 404 (naming `param`)
        when there is no such conversation."""
        keys = self._keys(tenant_id, conversation_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.exists(keys[0])
            pipe.lrange(keys[1], 0, -1)
            exists, items = await pipe.execute()
        if not exists:
            raise conversation_not_found(conversation_id, param)
        return [json.loads(item) for item in items]

    async def item(self, tenant_id: str, conversation_id: str, item_id: str) -> dict:
        """One item of the tenant's conversation, else a 404."""
        for item in await self.items(tenant_id, conversation_id):
            if item["id"] == item_id:
                return item
        raise item_not_found(item_id)

    async def delete_item(self, tenant_id: str, conversation_id: str, item_id: str) -> None:
        """Remove one item of the tenant's conversation, else a 404."""
        removed = await self._delete_item(keys=self._keys(tenant_id, conversation_id),
                                          args=[self._ttl_ms, item_id])
        if removed == -1:
            raise conversation_not_found(conversation_id)
        if removed == 0:
            raise item_not_found(item_id)

    def _keys(self, tenant_id: str, conversation_id: str) -> list[str]:
        return [f"{self._prefix}:conversation:{{{tenant_id}}}:{conversation_id}",
                f"{self._prefix}:conversation-items:{{{tenant_id}}}:{conversation_id}"]
