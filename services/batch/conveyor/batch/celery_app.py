"""The worker's Celery app: two tasks (start, chunk) on the Redis broker.

Tasks are acknowledged late and rejected (back to the queue) when their worker
is lost; a worker killed outright leaves its task unacknowledged, and the
broker delivers it again `visibility_timeout_s` after it was taken. Each task
runs its own asyncio loop (the worker uses the solo pool: one task at a time,
lines_in_flight lines inside it).
"""

from __future__ import annotations

import asyncio

from celery import Celery

from conveyor.batch.batch_starter import start_batch
from conveyor.batch.chunk_runner import run_chunk
from conveyor.batch.settings import BatchSettings
from conveyor.batch.worker_context import open_context
from conveyor.common.batch_queue import CHUNK_TASK, QUEUE, START_TASK, celery_config


def create_celery(settings: BatchSettings) -> Celery:
    app = Celery("conveyor-batch", broker=settings.broker, set_as_current=False)
    app.conf.update(celery_config(settings.redis_prefix, settings.visibility_timeout_s))

    def enqueue(name: str, args: list) -> None:
        app.send_task(name, args=args, queue=QUEUE)

    @app.task(name=START_TASK)
    def start(batch_id: str) -> None:
        asyncio.run(_in_context(settings, enqueue, start_batch, batch_id))

    @app.task(name=CHUNK_TASK)
    def chunk(batch_id: str, first: int, end: int, offset: int) -> None:
        asyncio.run(_in_context(settings, enqueue, run_chunk, batch_id, first, end, offset))

    return app


async def _in_context(settings: BatchSettings, enqueue, work, *args) -> None:
    async with open_context(settings, enqueue) as ctx:
        await work(ctx, *args)
