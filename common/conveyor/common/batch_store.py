"""Batches and their per-line results in Redis, shared by gateways and batch workers.

    {prefix}:batch:{batch_id}            HASH  the BatchRecord (status, times, counts, ...)
    {prefix}:batch:{batch_id}:results    HASH  line index -> {"ok", "line"} (JSON), written once
    {prefix}:batches:{tenant}            ZSET  batch_id -> created_at (the tenant's listing)
    {prefix}:batch-stats                 HASH  status:<s> -> batches, lines:<outcome> -> lines

Every status change and every line write is one Lua script (batch_lua), so a
line is counted once however often a chunk is redelivered, and nothing is
written for a batch that is no longer in progress (cancelling, expired).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from enum import IntEnum

from redis.asyncio import Redis

from conveyor.common import batch_lua
from conveyor.common.batch_record import BatchRecord, BatchStatus
from conveyor.common.engine_registry import require_decoded_responses
from conveyor.common.file_records import now_s


def new_batch_id() -> str:
    return f"batch_{secrets.token_hex(12)}"


class LineWrite(IntEnum):
    """What `record_line` did."""

    REFUSED = -1
    """The batch is not in progress (cancelling, expired...): nothing written."""
    DUPLICATE = 0
    """The line had been written already (a redelivered chunk)."""
    WRITTEN = 1
    LAST = 2
    """Written, and it was the batch's last line: the batch is now finalizing."""


@dataclass(slots=True, frozen=True)
class LineUsage:
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0


@dataclass(slots=True, frozen=True)
class LineResult:
    """One line's stored result: its output-file line, and whether it succeeded."""

    ok: bool
    line: dict


class BatchStore:
    """The one place batch state is read and changed."""

    def __init__(self, redis: Redis, prefix: str = "conveyor"):
        require_decoded_responses(redis)
        self._redis = redis
        self._prefix = prefix
        self._transition = redis.register_script(batch_lua.TRANSITION)
        self._record_line = redis.register_script(batch_lua.RECORD_LINE)

    @property
    def stats_key(self) -> str:
        """Batches per status and lines per outcome (the gateway's metrics read it)."""
        return f"{self._prefix}:batch-stats"

    async def create(self, record: BatchRecord) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(self._key(record.batch_id), mapping=record.to_hash())
            pipe.zadd(self._index(record.tenant_id), {record.batch_id: record.created_at})
            pipe.hincrby(self.stats_key, f"status:{record.status}", 1)
            await pipe.execute()

    async def get(self, batch_id: str) -> BatchRecord | None:
        row = await self._redis.hgetall(self._key(batch_id))
        return BatchRecord.from_hash(row) if row else None

    async def get_for(self, batch_id: str, tenant_id: str) -> BatchRecord | None:
        """The batch if it belongs to `tenant_id`; None (as if missing) otherwise."""
        record = await self.get(batch_id)
        return record if record is not None and record.tenant_id == tenant_id else None

    async def list(self, tenant_id: str, *, after: str | None = None,
                   limit: int = 20) -> tuple[list[BatchRecord], bool]:
        """The tenant's batches, newest first, those after `after`; and whether more follow."""
        start = 0
        if after is not None:
            rank = await self._redis.zrevrank(self._index(tenant_id), after)
            start = 0 if rank is None else rank + 1
        ids = await self._redis.zrevrange(self._index(tenant_id), start, start + limit)
        records = [r for r in [await self.get(i) for i in ids[:limit]] if r is not None]
        return records, len(ids) > limit

    async def transition(self, batch_id: str, allowed: tuple[BatchStatus, ...],
                         to: BatchStatus, **fields: str | int) -> tuple[bool, str]:
        """Move the batch to `to` if its status is one of `allowed`, setting `<to>_at`
        and `fields`. Returns (moved, the status it now has or had)."""
        extra = [str(x) for pair in fields.items() for x in pair]
        moved, status = await self._transition(
            keys=[self._key(batch_id), self.stats_key],
            args=[",".join(allowed), str(to), f"{to}_at", now_s(), *extra])
        return bool(int(moved)), status

    async def record_line(self, batch_id: str, index: int, result: LineResult,
                          usage: LineUsage) -> LineWrite:
        """Write line `index`'s result once, counting it and its tokens (see LineWrite)."""
        value = json.dumps({"ok": result.ok, "line": result.line})
        reply = await self._record_line(
            keys=[self._key(batch_id), self._results(batch_id), self.stats_key],
            args=[index, value, int(result.ok), usage.input_tokens, usage.output_tokens,
                  usage.cached_tokens, now_s()])
        return LineWrite(int(reply))

    async def finished_lines(self, batch_id: str) -> set[int]:
        return {int(i) for i in await self._redis.hkeys(self._results(batch_id))}

    async def results(self, batch_id: str) -> dict[int, LineResult]:
        rows = await self._redis.hgetall(self._results(batch_id))
        decoded = {int(i): json.loads(v) for i, v in rows.items()}
        return {i: LineResult(v["ok"], v["line"]) for i, v in decoded.items()}

    def _key(self, batch_id: str) -> str:
        return f"{self._prefix}:batch:{batch_id}"

    def _results(self, batch_id: str) -> str:
        return f"{self._prefix}:batch:{batch_id}:results"

    def _index(self, tenant_id: str) -> str:
        return f"{self._prefix}:batches:{tenant_id}"
