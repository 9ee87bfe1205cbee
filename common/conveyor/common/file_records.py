"""What is known about each file (owner, name, purpose, size), in Redis.

    {prefix}:file:{file_id}      HASH  tenant, filename, purpose, bytes, created_at
    {prefix}:files:{tenant}      ZSET  file_id -> created_at (the tenant's listing)

A file belongs to the tenant whose key uploaded it (or whose batch wrote it);
`get` with another tenant answers None, exactly as for a file that does not exist.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass

from redis.asyncio import Redis

from conveyor.common.engine_registry import require_decoded_responses


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


@dataclass(slots=True, frozen=True)
class FileRecord:
    """One stored file, as OpenAI's File object describes it."""

    file_id: str
    tenant_id: str
    filename: str
    purpose: str
    num_bytes: int
    created_at: int

    def to_openai(self) -> dict:
        return {"id": self.file_id, "object": "file", "bytes": self.num_bytes,
                "created_at": self.created_at, "filename": self.filename,
                "purpose": self.purpose, "status": "processed", "expires_at": None,
                "status_details": None}


class FileRecords:
    """File metadata shared by every gateway and batch worker."""

    def __init__(self, redis: Redis, prefix: str = "conveyor"):
        require_decoded_responses(redis)
        self._redis = redis
        self._prefix = prefix

    async def add(self, record: FileRecord) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(self._key(record.file_id), mapping={
                "tenant": record.tenant_id, "filename": record.filename,
                "purpose": record.purpose, "bytes": record.num_bytes,
                "created_at": record.created_at})
            pipe.zadd(self._index(record.tenant_id), {record.file_id: record.created_at})
            await pipe.execute()

    async def get(self, file_id: str, tenant_id: str) -> FileRecord | None:
        """The file if it exists and belongs to `tenant_id`, else None."""
        row = await self._redis.hgetall(self._key(file_id))
        if not row or row["tenant"] != tenant_id:
            return None
        return _record(file_id, row)

    async def list(self, tenant_id: str, *, purpose: str | None = None, limit: int = 10000,
                   after: str | None = None, newest_first: bool = True) -> list[FileRecord]:
        """The tenant's files in creation order, those after the file `after`."""
        ids = await self._redis.zrange(self._index(tenant_id), 0, -1, desc=newest_first)
        if after is not None and after in ids:
            ids = ids[ids.index(after) + 1:]
        async with self._redis.pipeline(transaction=False) as pipe:
            for file_id in ids:
                pipe.hgetall(self._key(file_id))
            rows = await pipe.execute()
        records = [_record(i, row) for i, row in zip(ids, rows, strict=True) if row]
        return [r for r in records if purpose is None or r.purpose == purpose][:limit]

    async def delete(self, file_id: str, tenant_id: str) -> bool:
        """Forget the file; False if the tenant has no such file."""
        if await self.get(file_id, tenant_id) is None:
            return False
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._key(file_id))
            pipe.zrem(self._index(tenant_id), file_id)
            await pipe.execute()
        return True

    def _key(self, file_id: str) -> str:
        return f"{self._prefix}:file:{file_id}"

    def _index(self, tenant_id: str) -> str:
        return f"{self._prefix}:files:{tenant_id}"


def now_s() -> int:
    """Unix seconds, as OpenAI's objects give their times."""
    return int(time.time())


def _record(file_id: str, row: dict[str, str]) -> FileRecord:
    return FileRecord(file_id, row["tenant"], row["filename"], row["purpose"],
                      int(row["bytes"]), int(row["created_at"]))
