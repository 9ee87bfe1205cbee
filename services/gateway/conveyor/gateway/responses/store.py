"""Stored responses (the Responses API's `store`), per tenant, in Redis.

    {prefix}:response:{tenant}:{response_id}   STRING  JSON {"response": <the Response
                                               object>, "conversation": [<chat messages>]}

`conversation` is every message of the exchange but the instructions (the earlier
turns, this turn's input, this turn's output), which a later request continues with
`previous_response_id`; OpenAI does not carry instructions over either. A record is
written once, when its response is complete, in the settlement's Redis round trip
(`save_call`), and expires `ttl_s` later. The tenant is part of the key: another
tenant's id is not found (404), so ids cannot be probed across tenants.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from redis.asyncio import Redis

from conveyor.common.engine_registry import require_decoded_responses
from conveyor.common.redis_scripts import ScriptCall
from conveyor.gateway.errors import APIError

_SAVE_LUA = """
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[1])
return 1
"""


def response_not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.",
                    "invalid_request_error", param, "response_not_found")


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A stored response and the conversation that produced it."""

    response: dict
    conversation: list[dict]


class ResponseStore:
    """Writes, reads and deletes stored responses (see the module doc)."""

    def __init__(self, redis: Redis, *, prefix: str = "conveyor", ttl_s: float = 86400.0):
        require_decoded_responses(redis)
        self._redis = redis
        self._prefix = prefix
        self._ttl_ms = max(1, round(ttl_s * 1000))
        self._save = redis.register_script(_SAVE_LUA)

    def save_call(self, tenant_id: str, stored: StoredResponse) -> ScriptCall:
        """The write of `stored`, as a script call to run with the settlement."""
        record = json.dumps({"response": stored.response, "conversation": stored.conversation},
                            separators=(",", ":"))
        return ScriptCall(self._save, [self._key(tenant_id, stored.response["id"])],
                          [self._ttl_ms, record])

    async def get(self, tenant_id: str, response_id: str,
                  param: str | None = None) -> StoredResponse:
        """The tenant's stored response, else a 404 (naming `param`)."""
        text = await self._redis.get(self._key(tenant_id, response_id))
        if text is None:
            raise response_not_found(response_id, param)
        record = json.loads(text)
        return StoredResponse(record["response"], record["conversation"])

    async def delete(self, tenant_id: str, response_id: str) -> None:
        """Forget the tenant's stored response; a 404 when there is none."""
        if not await self._redis.delete(self._key(tenant_id, response_id)):
            raise response_not_found(response_id)

    def _key(self, tenant_id: str, response_id: str) -> str:
        return f"{self._prefix}:response:{{{tenant_id}}}:{response_id}"
