"""Writing a batch's output and error files, in input order, once its lines are done.

It runs when the last line was written (the batch is `finalizing`), when a
cancel was seen (`cancelling`), or when the window ran out (`finalizing` with
ending `expired`). Results are frozen by then (no line is written unless the
batch is in progress), so finalizing again after a crash writes the same files
under the same ids: the finalizer is idempotent.

A batch whose every line failed is still `completed`, with an error file and an
output file that is empty (never a null output_file_id). `fail_batch` ends a batch
that cannot run at all (its input failed validation or is gone).
"""

from __future__ import annotations

import json
import logging

from conveyor.batch.input_lines import read_lines
from conveyor.batch.line_sender import output_line
from conveyor.batch.worker_context import WorkerContext
from conveyor.common.batch_record import BatchRecord, BatchStatus
from conveyor.common.batch_store import LineResult
from conveyor.common.file_records import FileRecord, now_s

log = logging.getLogger("conveyor.batch")

OUTPUT_PURPOSE = "batch_output"
INPUT_MISSING = {"code": "input_file_missing", "param": "input_file_id", "line": None,
                 "message": "The batch's input file was deleted before the batch ran."}


async def fail_batch(ctx: WorkerContext, batch_id: str, errors: list[dict]) -> None:
    """validating / in_progress -> failed, with OpenAI's errors.data[]."""
    await ctx.batches.transition(batch_id, (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS),
                                 BatchStatus.FAILED, errors=json.dumps(errors))
    log.info("batch %s failed: %s", batch_id, ", ".join(e["code"] for e in errors))


async def finalize(ctx: WorkerContext, batch_id: str) -> None:
    record = await ctx.batches.get(batch_id)
    if record is None or record.status not in (BatchStatus.FINALIZING, BatchStatus.CANCELLING):
        return
    results = await ctx.batches.results(batch_id)
    outputs = [r.line for _, r in sorted(results.items()) if r.ok]
    errors = [r.line for _, r in sorted(results.items()) if not r.ok]
    if record.ending == BatchStatus.EXPIRED:
        errors = _with_expired(ctx, record, results)
    output_id = await _write(ctx, record, "output", outputs)
    error_id = await _write(ctx, record, "error", errors) if errors else None
    final = BatchStatus.CANCELLED if record.status is BatchStatus.CANCELLING \
        else BatchStatus(record.ending or BatchStatus.COMPLETED)
    fields = {"output_file_id": output_id, **({"error_file_id": error_id} if error_id else {})}
    moved, _ = await ctx.batches.transition(batch_id, (record.status,), final, **fields)
    if moved:
        log.info("batch %s %s: %d completed, %d failed", batch_id, final, record.completed,
                 record.failed)


def _with_expired(ctx: WorkerContext, record: BatchRecord,
                  results: dict[int, LineResult]) -> list[dict]:
    """The error lines, plus a batch_expired line for every line that did not run."""
    expired = {"code": "batch_expired",
               "message": "This line was not executed because the batch expired."}
    lines: list[dict] = []
    try:
        with ctx.files.open(record.input_file_id) as file:
            for line in read_lines(file, 0, 0, record.total):
                result = results.get(line.index)
                if result is None:
                    lines.append(output_line(line.custom_id, None, expired))
                elif not result.ok:
                    lines.append(result.line)
    except FileNotFoundError:  # the input was deleted: the lines' custom_ids are gone too
        log.warning("batch %s: input file gone, expired lines not listed", record.batch_id)
        return [r.line for _, r in sorted(results.items()) if not r.ok]
    return lines


async def _write(ctx: WorkerContext, record: BatchRecord, kind: str, lines: list[dict]) -> str:
    """The file under its fixed id (`file-<batch>-output` / `-error`) and its record."""
    file_id = f"file-{record.batch_id.removeprefix('batch_')}-{kind}"
    writer = ctx.files.writer(file_id)
    try:
        for line in lines:
            writer.write(json.dumps(line).encode() + b"\n")
        num_bytes = writer.commit()
    except BaseException:
        writer.abort()
        raise
    await ctx.file_records.add(FileRecord(file_id, record.tenant_id,
                                          f"{record.batch_id}_{kind}.jsonl", OUTPUT_PURPOSE,
                                          num_bytes, now_s()))
    return file_id
