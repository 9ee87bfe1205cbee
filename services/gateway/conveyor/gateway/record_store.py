"""What the gateway's stores of per-tenant records in Redis share (stored responses,
conversations, stored chat completions): the client, the key prefix, the records' time to
live."""

from __future__ import annotations

from redis.asyncio import Redis

from conveyor.common.engine_registry import require_decoded_responses


class RecordStore:
    """Records in Redis under `prefix`, each kept `ttl_s` (in ms: `_ttl_ms`)."""

    def __init__(self, redis: Redis, *, prefix: str = "conveyor", ttl_s: float = 86400.0):
        require_decoded_responses(redis)
        self._redis = redis
        self._prefix = prefix
        self._ttl_ms = max(1, round(ttl_s * 1000))
