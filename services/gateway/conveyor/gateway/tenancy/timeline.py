"""Per-request timelines: when each stage happened and what the request cost.

A request keeps its timeline as a `TimelineDraft` (stage times in memory) and saves it
twice: once admitted (arrival, admission, prompt tokens), so a running request shows
while it runs, and once finished (every stage, usage, engine, finish reason). Each save
writes every field known so far, so the last one alone makes a whole timeline. Its
tenant reads it at GET /v1/requests/{id}. A timeline expires `ttl_s` after its last
write.

    {prefix}:timeline:{request_id}   HASH  tenant, stage times, counts, engine, finish reason

Times are Unix seconds of the gateway's clock (one gateway handles a request).
A timeline belonging to another tenant is reported as not found, so ids of
other tenants' requests cannot be probed.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, fields
from enum import StrEnum
from typing import Any

from redis.asyncio import Redis

from conveyor.common.engine_registry import require_decoded_responses
from conveyor.gateway.tenancy.errors import TimelineNotFound


class Stage(StrEnum):
    """The moments of a request's life, in order."""

    ARRIVAL = "arrival"
    ADMITTED = "admitted"
    QUEUED = "queued"
    """Sent to the engine (its Generate stream opened)."""
    FIRST_TOKEN = "first_token"
    FINISHED = "finished"


@dataclass(slots=True, frozen=True)
class RequestTimeline:
    """One request's stages (Unix seconds, None until reached) and usage."""

    request_id: str
    tenant_id: str
    arrival: float | None = None
    admitted: float | None = None
    queued: float | None = None
    first_token: float | None = None
    finished: float | None = None
    num_prompt_tokens: int | None = None
    num_completion_tokens: int | None = None
    num_cached_tokens: int | None = None
    engine_id: str | None = None
    """The engine that served it (the last one, when it moved)."""
    num_moves: int | None = None
    """Times a generation moved to another engine after its engine failed mid-stream."""
    finish_reason: str | None = None

    @property
    def time_to_first_token_s(self) -> float | None:
        return _between(self.arrival, self.first_token)

    @property
    def duration_s(self) -> float | None:
        return _between(self.arrival, self.finished)

    def to_dict(self) -> dict[str, Any]:
        """The JSON body of GET /v1/requests/{id}."""
        return {**asdict(self), "time_to_first_token_s": self.time_to_first_token_s,
                "duration_s": self.duration_s}


_FIELD_TYPES = {f.name: f.type for f in fields(RequestTimeline)}
_RECORDABLE = set(_FIELD_TYPES) - {"request_id", "tenant_id"} - set(Stage)


class TimelineDraft:
    """One request's timeline as it happens; `save` writes what is known so far."""

    def __init__(self, store: TimelineStore, request_id: str):
        self._store = store
        self.request_id = request_id
        self._values: dict[str, int | str | float] = {Stage.ARRIVAL: time.time()}

    def mark(self, stage: Stage, **values: int | str) -> None:
        """`stage` happened now; `values` (see TimelineStore.record) are kept with it."""
        _check_recordable(values)
        self._values.update({Stage(stage): time.time(), **values})

    def record(self, **values: int | str) -> None:
        """Keep `values` (see TimelineStore.record) for the next save."""
        _check_recordable(values)
        self._values.update(values)

    def reached(self, stage: Stage) -> bool:
        return Stage(stage) in self._values

    async def save(self, tenant_id: str) -> None:
        """Write every stage and value known so far (one Redis round trip)."""
        await self._store.write(self.request_id, {"tenant_id": tenant_id, **self._values})


class TimelineStore:
    """Writes and reads request timelines in Redis."""

    def __init__(self, redis: Redis, *, prefix: str = "conveyor", ttl_s: float = 3600.0):
        require_decoded_responses(redis)
        self._redis = redis
        self._prefix = prefix
        self._ttl_ms = max(1, round(ttl_s * 1000))

    async def start(self, request_id: str, tenant_id: str, arrival: float | None = None) -> None:
        """Open the timeline of a request that just arrived."""
        when = time.time() if arrival is None else arrival
        await self._write(request_id, {"tenant_id": tenant_id, Stage.ARRIVAL: when})

    async def mark(self, request_id: str, stage: Stage, at: float | None = None,
                   **values: int | str) -> None:
        """Record that `stage` happened (now, unless `at` says when), and `values`
        (as `record` takes them) in the same write."""
        _check_recordable(values)
        await self._write(request_id, {Stage(stage): time.time() if at is None else at,
                                       **values})

    async def record(self, request_id: str, **values: int | str) -> None:
        """Record usage and outcome: num_prompt_tokens, num_completion_tokens,
        num_cached_tokens, engine_id, finish_reason."""
        _check_recordable(values)
        await self._write(request_id, values)

    async def get(self, request_id: str, tenant_id: str) -> RequestTimeline:
        """The timeline if it exists and belongs to `tenant_id`, else TimelineNotFound."""
        row = await self._redis.hgetall(self._key(request_id))
        if row.get("tenant_id") != tenant_id:
            raise TimelineNotFound(request_id)
        values = {name: _parse(_FIELD_TYPES[name], text) for name, text in row.items()
                  if name in _FIELD_TYPES}
        return RequestTimeline(request_id=request_id, **values)

    async def write(self, request_id: str, values: dict[str, Any]) -> None:
        """Set these fields of the timeline (one transaction) and renew its expiry."""
        await self._write(request_id, values)

    async def _write(self, request_id: str, values: dict[str, Any]) -> None:
        key = self._key(request_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping={str(name): str(value) for name, value in values.items()})
            pipe.pexpire(key, self._ttl_ms)
            await pipe.execute()

    def _key(self, request_id: str) -> str:
        return f"{self._prefix}:timeline:{request_id}"


def _check_recordable(values: dict[str, Any]) -> None:
    unknown = set(values) - _RECORDABLE
    if unknown:
        raise ValueError(f"not timeline fields: {sorted(unknown)}; known: {sorted(_RECORDABLE)}")


def _parse(annotation: str, text: str) -> Any:
    if annotation.startswith("float"):
        return float(text)
    if annotation.startswith("int"):
        return int(text)
    return text


def _between(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start
