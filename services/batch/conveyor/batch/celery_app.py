"""The worker's Celery app: two tasks (start, chunk) on the Redis broker.

Tasks are acknowledged late and rejected (back to the queue) when their worker
is lost; a worker killed outright leaves its task unacknowledged, and the
broker delivers it again `visibility_timeout_s` after it was taken. Each task
runs its own asyncio loop (the worker uses the solo pool: one task at a time,
lines_in_flight lines inside it). SIGTERM is a warm shutdown: the chunk under way
finishes its lines in flight and hands the rest on (chunk_runner). A task that fails on
Redis or the disk (a Redis failover, a full volume) is retried with backoff rather than
dropped, so its batch never waits forever on a chunk that is gone.
"""

from __future__ import annotations

import asyncio
import threading

from celery import Celery
from celery.signals import worker_shutting_down
from redis.exceptions import RedisError

from conveyor.batch.batch_starter import start_batch
from conveyor.batch.chunk_runner import run_chunk
from conveyor.batch.settings import BatchSettings
from conveyor.batch.worker_context import open_context
from conveyor.common.batch_queue import CHUNK_TASK, QUEUE, START_TASK, celery_config

_TRANSIENT = (RedisError, OSError)
"""Failures of a task worth retrying (a bug's exception is not: it is logged)."""


def create_celery(settings: BatchSettings) -> Celery:
    app = Celery("conveyor-batch", broker=settings.broker, set_as_current=False)
    app.conf.update(celery_config(settings.redis_prefix, settings.visibility_timeout_s))
    stopping = threading.Event()
    worker_shutting_down.connect(lambda **_: stopping.set(), weak=False)

    def enqueue(name: str, args: list) -> None:
        app.send_task(name, args=args, queue=QUEUE)

    retried = {"autoretry_for": _TRANSIENT, "retry_backoff": True, "retry_backoff_max": 60,
               "max_retries": None}

    @app.task(name=START_TASK, **retried)
    def start(batch_id: str) -> None:
        asyncio.run(_in_context(settings, enqueue, stopping, start_batch, batch_id))

    @app.task(name=CHUNK_TASK, **retried)
    def chunk(batch_id: str, first: int, end: int, offset: int) -> None:
        asyncio.run(_in_context(settings, enqueue, stopping, run_chunk, batch_id, first, end,
                                offset))

    return app


async def _in_context(settings: BatchSettings, enqueue, stopping: threading.Event, work,
                      *args) -> None:
    async with open_context(settings, enqueue, stopping) as ctx:
        await work(ctx, *args)
