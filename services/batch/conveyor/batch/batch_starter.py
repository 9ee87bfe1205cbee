"""The start task: validate a new batch's input file and enqueue its chunks.

validating -> failed (with `errors`) when any line is bad, else -> in_progress
with its total, then one chunk task per `chunk_size` lines. Delivered again
after a crash it finds the batch in progress and enqueues the chunks again:
lines already written are skipped by the chunks, so nothing runs twice in the
output (a line may at worst be generated twice if the crash fell between two
enqueues).
"""

from __future__ import annotations

import logging

from conveyor.batch.finalizer import INPUT_MISSING, fail_batch, finalize
from conveyor.batch.input_lines import ValidatedInput, validate_input
from conveyor.batch.worker_context import WorkerContext
from conveyor.common.batch_queue import CHUNK_TASK
from conveyor.common.batch_record import BatchRecord, BatchStatus

log = logging.getLogger("conveyor.batch")


async def start_batch(ctx: WorkerContext, batch_id: str) -> None:
    record = await ctx.batches.get(batch_id)
    if record is None:
        log.warning("batch %s: no such batch, task dropped", batch_id)
        return
    try:
        if record.status is BatchStatus.CANCELLING:
            await finalize(ctx, batch_id)
        elif record.status is BatchStatus.IN_PROGRESS:
            _enqueue_chunks(ctx, record, _validate(ctx, record))
        elif record.status is BatchStatus.VALIDATING:
            await _validate_and_start(ctx, record)
    except FileNotFoundError:
        await fail_batch(ctx, batch_id, [INPUT_MISSING])


async def _validate_and_start(ctx: WorkerContext, record: BatchRecord) -> None:
    checked = _validate(ctx, record)
    if checked.errors:
        await fail_batch(ctx, record.batch_id, [e.to_openai() for e in checked.errors])
        return
    moved, status = await ctx.batches.transition(
        record.batch_id, (BatchStatus.VALIDATING,), BatchStatus.IN_PROGRESS, total=checked.total)
    if not moved:
        if status == BatchStatus.CANCELLING:
            await finalize(ctx, record.batch_id)
        return
    record.total = checked.total
    _enqueue_chunks(ctx, record, checked)


def _validate(ctx: WorkerContext, record: BatchRecord) -> ValidatedInput:
    with ctx.files.open(record.input_file_id) as file:
        return validate_input(file, record.endpoint, ctx.settings.chunk_size)


def _enqueue_chunks(ctx: WorkerContext, record: BatchRecord, checked: ValidatedInput) -> None:
    starts = checked.chunk_starts
    for i, (first, offset) in enumerate(starts):
        end = starts[i + 1][0] if i + 1 < len(starts) else checked.total
        ctx.enqueue(CHUNK_TASK, [record.batch_id, first, end, offset])
    log.info("batch %s: %d lines in %d chunks", record.batch_id, checked.total, len(starts))
