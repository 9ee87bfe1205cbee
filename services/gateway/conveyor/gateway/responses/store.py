"""Stored responses (the Responses API's `store`), per tenant, in Redis.

    {prefix}:response:{tenant}:{response_id}   STRING  JSON {"response": <the Response
                                               object>, "conversation": [<chat messages>]}
    {prefix}:response-run:{tenant}:{id}        HASH    status, lease_until, error: a
                                               background response not finished yet
    {prefix}:response-events:{tenant}:{id}     STREAM  a streamed background response's
                                               events, entry 0-(n+1) = sequence_number n

`conversation` is every message of the exchange but the instructions (the earlier
turns, this turn's input, this turn's output once there is one), which a later request
continues with `previous_response_id`; OpenAI does not carry instructions over either.
A record is written when its response is complete, in the settlement's Redis round trip
(`save_call`), and expires `ttl_s` later. The tenant is part of the key: another
tenant's id is not found (404), so ids cannot be probed across tenants.

A background response (background.py) is written at once, as `queued`, with its run:
the run's status (queued, in_progress, cancelled, failed) is the response's until the
complete response replaces the record, which happens only over an in_progress run (so a
cancel, a failure or a DELETE that came first stands). A run whose lease ran out (its
gateway replica died) reads as failed. Leases are on Redis's clock. A streamed run's
events are appended only while the run is live; its final event is written by the same
script that completes or fails it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from redis.asyncio import Redis

from conveyor.common.redis_scripts import ScriptCall
from conveyor.gateway.errors import APIError, bad_request
from conveyor.gateway.record_store import RecordStore

_NOW = """
if redis.replicate_commands then redis.replicate_commands() end
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1e6
"""
"""Leases are read and written on Redis's clock, never a replica's."""

_SAVE_LUA = _NOW + """
if ARGV[3] == '1' then
  local run = redis.call('HMGET', KEYS[2], 'status', 'lease_until')
  if run[1] ~= 'in_progress' or tonumber(run[2]) < now then return 0 end
  redis.call('DEL', KEYS[2])
  if ARGV[4] ~= '' then
    redis.pcall('XADD', KEYS[3], ARGV[4], 'e', ARGV[5], 'final', '1')
    redis.call('PEXPIRE', KEYS[3], ARGV[1])
  end
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[1])
return 1
"""
"""Writes a complete response; a background one only over its run while in progress
and leased (a run whose lease ran out already reads failed), with its stream's final
event (ARGV[4], ARGV[5]), so that a reader sees that event only once the response reads
complete."""

_CREATE_LUA = _NOW + """
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[1])
redis.call('HSET', KEYS[2], 'status', 'queued', 'lease_until', now + tonumber(ARGV[3]))
redis.call('PEXPIRE', KEYS[2], ARGV[1])
return 1
"""

_ADVANCE_LUA = _NOW + """
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'queued' and status ~= 'in_progress' then return status end
if tonumber(redis.call('HGET', KEYS[1], 'lease_until')) < now then
  status = 'failed'
  redis.call('HSET', KEYS[1], 'error', ARGV[3])
else
  status = ARGV[1]
  redis.call('HSET', KEYS[1], 'lease_until', now + tonumber(ARGV[2]))
  if ARGV[1] == 'failed' then redis.call('HSET', KEYS[1], 'error', ARGV[4]) end
  if ARGV[5] ~= '' then
    redis.pcall('XADD', KEYS[2], ARGV[5], 'e', ARGV[6], 'final', '1')
    redis.call('PEXPIRE', KEYS[2], ARGV[7])
  end
end
redis.call('HSET', KEYS[1], 'status', status)
return status
"""
"""Moves a live run (queued or in_progress) to ARGV[1] (in_progress, renewing its lease
for ARGV[2] seconds; cancelled; failed with ARGV[4], its stream's final event ARGV[5],
ARGV[6] written with it); a run whose lease ran out fails with ARGV[3]. Returns the run's
status after the call (false when there is no run)."""

_APPEND_LUA = """
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'queued' and status ~= 'in_progress' then return 0 end
for i = 2, #ARGV, 2 do
  redis.pcall('XADD', KEYS[2], ARGV[i], 'e', ARGV[i + 1], 'final', '0')
end
redis.call('PEXPIRE', KEYS[2], ARGV[1])
return 1
"""
"""Appends a streamed run's events (ARGV[2..]: id, event pairs, in order) while the run
is live (never after a cancel, a DELETE or its end); an id already there (a retried call)
is left as it is."""

Event = tuple[int, bytes]
"""A streamed response's event: its sequence_number and its SSE bytes."""

LEASE_LOST = {"code": "server_error",
              "message": "the gateway replica generating this response stopped"}

_LIVE = ("queued", "in_progress")


def response_not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.",
                    "invalid_request_error", param, "response_not_found")


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A stored response and the conversation that produced it (with its answer once
    the response is complete)."""

    response: dict
    conversation: list[dict]

    @property
    def answered(self) -> bool:
        return self.response["status"] in ("completed", "incomplete")


class ResponseStore(RecordStore):
    """Writes, reads and deletes stored responses (see the module doc)."""

    def __init__(self, redis: Redis, **options):
        super().__init__(redis, **options)
        self._save = redis.register_script(_SAVE_LUA)
        self._create = redis.register_script(_CREATE_LUA)
        self._advance = redis.register_script(_ADVANCE_LUA)
        self._append = redis.register_script(_APPEND_LUA)

    def save_call(self, tenant_id: str, stored: StoredResponse,
                  final_event: Event | None = None) -> ScriptCall:
        """The write of `stored`, as a script call to run with the settlement (a background
        response's only over its in_progress run, with its stream's final event)."""
        response_id = stored.response["id"]
        background = "1" if stored.response.get("background") else "0"
        return ScriptCall(self._save, [self._key(tenant_id, response_id),
                                       self._run_key(tenant_id, response_id),
                                       self._events_key(tenant_id, response_id)],
                          [self._ttl_ms, _record(stored), background, *_event_args(final_event)])

    async def create_background(self, tenant_id: str, stored: StoredResponse,
                                lease_s: float) -> None:
        """Store a background response as queued, its run leased for `lease_s`."""
        response_id = stored.response["id"]
        await self._create(keys=[self._key(tenant_id, response_id),
                                 self._run_key(tenant_id, response_id)],
                           args=[self._ttl_ms, _record(stored), lease_s])

    async def advance(self, tenant_id: str, response_id: str, status: str,
                      lease_s: float = 0.0, error: dict | None = None,
                      final_event: Event | None = None) -> str | None:
        """Move the live run to `status` (see _ADVANCE_LUA); its status afterwards."""
        return await self._advance(
            keys=[self._run_key(tenant_id, response_id),
                  self._events_key(tenant_id, response_id)],
            args=[status, lease_s, json.dumps(LEASE_LOST), json.dumps(error or {}),
                  *_event_args(final_event), self._ttl_ms])

    async def append_events(self, tenant_id: str, response_id: str,
                            events: list[Event]) -> None:
        """Record events of a streamed background response, in order, in one round trip,
        while its run is live."""
        await self._append(keys=[self._run_key(tenant_id, response_id),
                                 self._events_key(tenant_id, response_id)],
                           args=[self._ttl_ms, *(a for e in events for a in _event_args(e))])

    async def is_live(self, tenant_id: str, response_id: str) -> bool:
        """Whether the response's run is queued or in progress and leased (by Redis's clock)."""
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hmget(self._run_key(tenant_id, response_id), "status", "lease_until")
            pipe.time()
            (status, lease_until), (seconds, microseconds) = await pipe.execute()
        return status in _LIVE and float(lease_until) >= seconds + microseconds / 1e6

    async def read_events(self, tenant_id: str, response_id: str, after: int,
                          block_ms: int | None) -> list[tuple[int, bytes, bool]]:
        """(sequence_number, event, final) of the events after `after`, waiting up to
        `block_ms` for one (None: not at all); [] when none came."""
        key = self._events_key(tenant_id, response_id)
        reply = await self._redis.xread({key: f"0-{after + 1}"}, block=block_ms, count=256)
        return [(int(entry_id.split("-")[1]) - 1, fields["e"].encode(), fields["final"] == "1")
                for _, entries in reply for entry_id, fields in entries]

    async def has_events(self, tenant_id: str, response_id: str) -> bool:
        return bool(await self._redis.exists(self._events_key(tenant_id, response_id)))

    async def get(self, tenant_id: str, response_id: str,
                  param: str | None = None) -> StoredResponse:
        """The tenant's stored response, else a 404 (naming `param`); a background
        response not finished yet carries its run's status (and error)."""
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.get(self._key(tenant_id, response_id))
            pipe.hgetall(self._run_key(tenant_id, response_id))
            pipe.time()
            text, run, (seconds, microseconds) = await pipe.execute()
        if text is None:
            raise response_not_found(response_id, param)
        record = json.loads(text)
        response = record["response"]
        if run:
            response |= _run_state(run, seconds + microseconds / 1e6)
        return StoredResponse(response, record["conversation"])

    async def get_answered(self, tenant_id: str, response_id: str,
                           param: str) -> StoredResponse:
        """The tenant's stored response, which must be complete (to be continued)."""
        stored = await self.get(tenant_id, response_id, param)
        if not stored.answered:
            raise bad_request(f"Response '{response_id}' is {stored.response['status']}; only "
                              "a completed or incomplete response can be continued", param)
        return stored

    async def delete(self, tenant_id: str, response_id: str) -> None:
        """Forget the tenant's stored response (and its run); a 404 when there is none."""
        if not await self._redis.delete(self._key(tenant_id, response_id),
                                        self._run_key(tenant_id, response_id),
                                        self._events_key(tenant_id, response_id)):
            raise response_not_found(response_id)

    def saved_keys(self, tenant_id: str, response_id: str) -> list[str]:
        """The keys that say a background response's save went through: its run is gone
        (the save deletes it) and its record is there."""
        return [self._run_key(tenant_id, response_id), self._key(tenant_id, response_id)]

    def _key(self, tenant_id: str, response_id: str) -> str:
        return f"{self._prefix}:response:{{{tenant_id}}}:{response_id}"

    def _run_key(self, tenant_id: str, response_id: str) -> str:
        return f"{self._prefix}:response-run:{{{tenant_id}}}:{response_id}"

    def _events_key(self, tenant_id: str, response_id: str) -> str:
        return f"{self._prefix}:response-events:{{{tenant_id}}}:{response_id}"


def _event_args(event: Event | None) -> list:
    """A script's (entry id, SSE bytes) of `event`: entry 0-(n+1) holds sequence_number n."""
    return ["", b""] if event is None else [f"0-{event[0] + 1}", event[1]]


def _record(stored: StoredResponse) -> str:
    return json.dumps({"response": stored.response, "conversation": stored.conversation},
                      separators=(",", ":"))


def _run_state(run: dict[str, str], now: float) -> dict:
    """The response fields a run not finished yet sets: its status and error (a live run
    whose lease ran out by Redis's clock `now` reads as failed)."""
    status = run["status"]
    if status in _LIVE and float(run["lease_until"]) < now:
        return {"status": "failed", "error": LEASE_LOST}
    error = json.loads(run["error"]) if run.get("error") else None
    return {"status": status, "error": error}
