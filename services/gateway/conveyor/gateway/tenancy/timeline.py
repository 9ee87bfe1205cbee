"""Per-request timelines: when each stage happened and what the request cost.

A request keeps its timeline as a `TimelineDraft` (stage times in memory) and writes it
twice, each time inside a script the request runs anyway, so a timeline costs no round
trip of its own: once admitted, inside the ADMIT script (arrival, admission, prompt
tokens), so a running request shows while it runs, and once over, inside the SETTLE
script (every stage, usage, engine, end state). Each write sets every field known so
far, so the last one alone makes a whole timeline. A request that never reached
admission (or a batch line, whose admission touches no Redis) writes it alone
(`TimelineStore.write`). Its tenant reads it at GET /v1/requests/{id}. A timeline
expires `ttl_s` after its last write.

    {prefix}:timeline:{tenant}:{request_id}   HASH  tenant, stage times, counts, engine,
                                              finish reason

The {tenant} hash tag puts a timeline in the Redis Cluster slot of its tenant's quota
keys, so one script may write both. Times are Unix seconds of the gateway's clock (one
gateway handles a request). A timeline belonging to another tenant is reported as not
found, so ids of other tenants' requests cannot be probed.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, fields
from enum import StrEnum
from typing import Any

from redis.asyncio import Redis

from conveyor.common.redis_scripts import ScriptCall
from conveyor.gateway.record_store import RecordStore
from conveyor.gateway.tenancy.errors import TimelineNotFound

TIMELINE_LUA = """
-- write_timeline(key, argv, first): set the fields argv[first + 1], argv[first + 2], ...
-- (name, value, name, value, ...) of one timeline and renew its expiry, argv[first] ms.
local function write_timeline(key, argv, first)
  redis.call('HSET', key, unpack(argv, first + 1))
  redis.call('PEXPIRE', key, argv[first])
end
"""
"""The Lua function the scripts that carry a timeline write (`TimelineWrite`) define."""

_WRITE_LUA = TIMELINE_LUA + """
write_timeline(KEYS[1], ARGV, 1)
return 1
"""


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
    num_draft_tokens: int | None = None
    """Draft tokens speculative decoding verified for its finished samples (0 when the
    engine proposed none)."""
    num_accepted_draft_tokens: int | None = None
    """Of those, the ones accepted (a draft after the token that finished a sample counts)."""
    engine_id: str | None = None
    """The engine that served it (the last one, when it moved)."""
    num_moves: int | None = None
    """Times a generation moved to another engine after its engine failed mid-stream."""
    finish_reason: str | None = None
    metadata: str | None = None
    """The request's metadata (JSON text of its key-value pairs)."""
    safety_identifier: str | None = None
    """The caller's identifier of its end user (OpenAI's safety_identifier)."""

    @property
    def time_to_first_token_s(self) -> float | None:
        return _between(self.arrival, self.first_token)

    @property
    def duration_s(self) -> float | None:
        return _between(self.arrival, self.finished)

    def to_dict(self) -> dict[str, Any]:
        """The JSON body of GET /v1/requests/{id}."""
        return {**asdict(self), "metadata": json.loads(self.metadata) if self.metadata else None,
                "time_to_first_token_s": self.time_to_first_token_s,
                "duration_s": self.duration_s}


_FIELD_TYPES = {f.name: f.type for f in fields(RequestTimeline)}
_RECORDABLE = set(_FIELD_TYPES) - {"request_id", "tenant_id"} - set(Stage)


@dataclass(slots=True, frozen=True)
class TimelineWrite:
    """The fields to set on one timeline and its expiry, for a script to write in the
    same round trip as its own work: one key of the script's and `args` as its
    arguments from some index `first` on (`write_timeline(key, ARGV, first)`)."""

    key: str
    ttl_ms: int
    fields: tuple[str, ...]
    """name, value, name, value, ... (values as text)."""

    @property
    def args(self) -> list[str | int]:
        return [self.ttl_ms, *self.fields]


class TimelineDraft:
    """One request's timeline as it happens; `pending` is the write of what is known."""

    def __init__(self, store: TimelineStore, request_id: str):
        self._store = store
        self.request_id = request_id
        self._values: dict[str, int | str | float] = {Stage.ARRIVAL: time.time()}

    def mark(self, stage: Stage, at: float | None = None, **values: int | str) -> None:
        """`stage` happened (now, unless `at` says when); `values` (see `record`) are
        kept with it."""
        _check_recordable(values)
        self._values.update({Stage(stage): time.time() if at is None else at, **values})

    def record(self, **values: int | str) -> None:
        """Keep usage and outcome for the next write: num_prompt_tokens,
        num_completion_tokens, num_cached_tokens, num_draft_tokens,
        num_accepted_draft_tokens, engine_id, num_moves, finish_reason,
        and what the request says of itself: metadata, safety_identifier."""
        _check_recordable(values)
        self._values.update(values)

    def reached(self, stage: Stage) -> bool:
        return Stage(stage) in self._values

    def pending(self, tenant_id: str, **extra: float | int | str) -> TimelineWrite:
        """The write of every stage and value known so far, and of `extra` (stage times
        and values not kept yet, e.g. an admission about to be tried)."""
        unknown = set(extra) - _RECORDABLE - set(Stage)
        if unknown:
            raise ValueError(f"not timeline fields: {sorted(unknown)}")
        return self._store.write_of(self.request_id, tenant_id, {**self._values, **extra})

    async def save(self, tenant_id: str) -> None:
        """Write every stage and value known so far (one Redis round trip)."""
        await self._store.write(self.pending(tenant_id))


class TimelineStore(RecordStore):
    """Writes and reads request timelines in Redis."""

    def __init__(self, redis: Redis, *, prefix: str = "conveyor", ttl_s: float = 3600.0):
        super().__init__(redis, prefix=prefix, ttl_s=ttl_s)
        self._write = redis.register_script(_WRITE_LUA)

    def write_of(self, request_id: str, tenant_id: str,
                 values: dict[str, Any]) -> TimelineWrite:
        """The write setting `values` on the timeline of `request_id` (of `tenant_id`)."""
        fields = {"tenant_id": tenant_id, **values}
        return TimelineWrite(self._key(request_id, tenant_id), self._ttl_ms,
                             tuple(str(part) for item in fields.items() for part in item))

    def write_call(self, write: TimelineWrite) -> ScriptCall:
        """`write` as a script call of its own (see common.redis_scripts)."""
        return ScriptCall(self._write, [write.key], write.args)

    async def write(self, write: TimelineWrite) -> None:
        """Set these fields of the timeline and renew its expiry (one round trip)."""
        await self._write(keys=[write.key], args=write.args)

    async def get(self, request_id: str, tenant_id: str) -> RequestTimeline:
        """The timeline if it exists and belongs to `tenant_id`, else TimelineNotFound."""
        row = await self._redis.hgetall(self._key(request_id, tenant_id))
        if row.get("tenant_id") != tenant_id:
            raise TimelineNotFound(request_id)
        values = {name: _parse(_FIELD_TYPES[name], text) for name, text in row.items()
                  if name in _FIELD_TYPES}
        return RequestTimeline(request_id=request_id, **values)

    def _key(self, request_id: str, tenant_id: str) -> str:
        return f"{self._prefix}:timeline:{{{tenant_id}}}:{request_id}"


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
