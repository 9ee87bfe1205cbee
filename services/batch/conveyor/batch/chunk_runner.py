"""The chunk task: run lines [first, end) of a batch, at most lines_in_flight at a time.

Lines already written (a redelivered chunk) are skipped. Between lines the
batch's status is checked: cancelled or expired, the lines in flight are
cancelled (their HTTP requests closed: the gateway aborts them in the engine)
and the batch is finalized. A chunk stops taking lines at half the broker's
visibility timeout and hands the rest to a new chunk task, so a live chunk is
never delivered to a second worker. On SIGTERM (ctx.stopping) it does the same at once:
the lines in flight finish, the rest goes back to the queue, and the worker exits.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

from conveyor.batch.finalizer import INPUT_MISSING, fail_batch, finalize
from conveyor.batch.input_lines import InputLine, read_lines
from conveyor.batch.line_sender import LineSender, output_line
from conveyor.batch.worker_context import WorkerContext
from conveyor.common.batch_queue import CHUNK_TASK
from conveyor.common.batch_record import BatchRecord, BatchStatus
from conveyor.common.batch_store import LineResult, LineUsage, LineWrite

log = logging.getLogger("conveyor.batch")


async def run_chunk(ctx: WorkerContext, batch_id: str, first: int, end: int,
                    offset: int) -> None:
    record = await ctx.batches.get(batch_id)
    if record is None:
        return
    if await _stopping(ctx, record):
        await finalize(ctx, batch_id)
        return
    done = await ctx.batches.finished_lines(batch_id)
    try:
        with ctx.files.open(record.input_file_id) as file:
            lines = deque(line for line in read_lines(file, offset, first, end)
                          if line.index not in done)
    except FileNotFoundError:
        await fail_batch(ctx, batch_id, [INPUT_MISSING])
        return
    sender = LineSender(ctx.http, batch_id, ctx.settings.gateway_token,
                        ctx.settings.max_backoff_s)
    stopped = await _run_lines(ctx, record, sender, lines)
    if stopped:
        await finalize(ctx, batch_id)
    elif lines:
        ctx.enqueue(CHUNK_TASK, [batch_id, lines[0].index, end, lines[0].offset])
        log.info("batch %s: chunk handed on at line %d", batch_id, lines[0].index)


async def _run_lines(ctx: WorkerContext, record: BatchRecord, sender: LineSender,
                     lines: deque[InputLine]) -> bool:
    """Run lines until none is left, the chunk's time is up (lines left in `lines`)
    or the batch stops; True when it stopped."""
    settings = ctx.settings
    deadline = time.monotonic() + settings.visibility_timeout_s / 2
    running: set[asyncio.Task] = set()
    try:
        while lines or running:
            while lines and len(running) < settings.lines_in_flight \
                    and time.monotonic() < deadline and not ctx.stopping.is_set():
                running.add(asyncio.create_task(_run_line(ctx, sender, record, lines.popleft())))
            if not running:
                return False
            done, running = await asyncio.wait(running, timeout=settings.poll_interval_s,
                                               return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
            if await _stopping(ctx, await ctx.batches.get(record.batch_id) or record):
                return True
        return False
    finally:
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)


async def _run_line(ctx: WorkerContext, sender: LineSender, record: BatchRecord,
                    line: InputLine) -> None:
    try:
        result, usage = await sender.send(line)
    except Exception as error:  # noqa: BLE001 - a fault fails the line, never the batch
        log.exception("line %s failed", line.custom_id)
        error_body = {"code": "internal_error", "message": f"the batch worker failed: {error}"}
        result, usage = LineResult(False, output_line(line.custom_id, None, error_body)), \
            LineUsage()
    written = await ctx.batches.record_line(record.batch_id, line.index, result, usage)
    if written is LineWrite.LAST:
        await finalize(ctx, record.batch_id)


async def _stopping(ctx: WorkerContext, record: BatchRecord) -> bool:
    """True when the batch no longer runs lines: cancelled, finalizing, or past its
    window (then it is moved to finalizing with ending `expired`)."""
    if record.status is not BatchStatus.IN_PROGRESS:
        return True
    if time.time() < record.expires_at:
        return False
    await ctx.batches.transition(record.batch_id, (BatchStatus.IN_PROGRESS,),
                                 BatchStatus.FINALIZING, ending=BatchStatus.EXPIRED)
    return True
