"""What one task of the batch worker works with, opened per task and closed after it."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx
from redis.asyncio import Redis

from conveyor.batch.settings import BatchSettings
from conveyor.common.batch_store import BatchStore
from conveyor.common.file_records import FileRecords
from conveyor.common.file_store import DirectoryFileStore, FileStore

Enqueue = Callable[[str, list], None]
"""Sends a task by name with its arguments (the Celery app's send_task)."""


@dataclass(slots=True)
class WorkerContext:
    settings: BatchSettings
    batches: BatchStore
    file_records: FileRecords
    files: FileStore
    http: httpx.AsyncClient
    enqueue: Enqueue
    stopping: threading.Event = field(default_factory=threading.Event)
    """Set on SIGTERM: chunks take no new line and hand the rest on."""


@asynccontextmanager
async def open_context(settings: BatchSettings, enqueue: Enqueue,
                       stopping: threading.Event) -> AsyncIterator[WorkerContext]:
    redis = Redis.from_url(settings.redis_url, decode_responses=True)
    limits = httpx.Limits(max_connections=settings.lines_in_flight * 2)
    http = httpx.AsyncClient(base_url=settings.gateway_url, timeout=settings.line_timeout_s,
                             limits=limits)
    try:
        yield WorkerContext(settings, BatchStore(redis, settings.redis_prefix),
                            FileRecords(redis, settings.redis_prefix),
                            DirectoryFileStore(settings.files_dir), http, enqueue, stopping)
    finally:
        await http.aclose()
        await redis.aclose()
