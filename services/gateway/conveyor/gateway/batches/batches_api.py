"""The OpenAI Batches API: POST/GET /v1/batches, GET /v1/batches/{id}, POST .../cancel.

Creating a batch stores it (`validating`) and sends the workers its start task;
the workers validate the input, run the lines and finalize (conveyor.batch).
A batch belongs to the tenant whose key created it; to any other tenant it does
not exist (404), so it can be neither seen nor cancelled.
"""

from __future__ import annotations

import json
import logging

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, Field
from starlette.responses import Response

from conveyor.common.batch_queue import START_TASK
from conveyor.common.batch_record import (
    COMPLETION_WINDOW,
    COMPLETION_WINDOW_S,
    ENDPOINTS,
    BatchRecord,
    BatchStatus,
)
from conveyor.common.batch_store import new_batch_id
from conveyor.common.file_records import now_s
from conveyor.gateway.api.pages import list_page
from conveyor.gateway.batches.batch_services import BatchServices, serve
from conveyor.gateway.batches.files_api import file_not_found
from conveyor.gateway.errors import APIError, bad_request, unavailable

log = logging.getLogger("conveyor.gateway.batches")
router = APIRouter()

_CANCELLABLE = (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)


class CreateBatchRequest(BaseModel):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = Field(None, max_length=16)


def batch_not_found(batch_id: str) -> APIError:
    return APIError(404, f"No batch found with id '{batch_id}'.", "invalid_request_error", "id")


@router.post("/v1/batches")
async def create_batch(body: CreateBatchRequest, request: Request) -> Response:
    async def work(services: BatchServices) -> dict:
        tenant = await services.tenant(request)
        _check(body)
        file = await services.file_records.get(body.input_file_id, tenant.tenant_id)
        if file is None:
            raise file_not_found(body.input_file_id)
        if file.purpose != "batch":
            raise bad_request(f"File {file.file_id} has purpose {file.purpose!r}; a batch's "
                              "input needs purpose 'batch'.", "input_file_id")
        created = now_s()
        record = BatchRecord(new_batch_id(), tenant.tenant_id, tenant.tier.name, body.endpoint,
                             file.file_id, created, created + COMPLETION_WINDOW_S,
                             metadata=body.metadata)
        await services.batches.create(record)
        await _start(services, record)
        return record.to_openai()

    return await serve(request, "batches", work)


@router.get("/v1/batches")
async def list_batches(request: Request, after: str | None = None,
                       limit: int = Query(20, ge=1, le=100)) -> Response:
    async def work(services: BatchServices) -> dict:
        tenant = await services.tenant(request)
        records, has_more = await services.batches.list(tenant.tenant_id, after=after,
                                                        limit=limit)
        return list_page([r.to_openai() for r in records], has_more)

    return await serve(request, "batches", work)


@router.get("/v1/batches/{batch_id}")
async def get_batch(batch_id: str, request: Request) -> Response:
    async def work(services: BatchServices) -> dict:
        return (await _own_batch(services, request, batch_id)).to_openai()

    return await serve(request, "batches", work)


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request) -> Response:
    """validating / in_progress -> cancelling; a worker cancels the lines in flight,
    writes the files of the finished ones and moves it to cancelled."""
    async def work(services: BatchServices) -> dict:
        record = await _own_batch(services, request, batch_id)
        moved, status = await services.batches.transition(batch_id, _CANCELLABLE,
                                                          BatchStatus.CANCELLING)
        if not moved and status not in (BatchStatus.CANCELLING, BatchStatus.CANCELLED):
            raise APIError(409, f"Cannot cancel a batch with status {status!r}.",
                           "invalid_request_error", None, "batch_not_cancellable")
        return (await services.batches.get(batch_id) or record).to_openai()

    return await serve(request, "batches", work)


def _check(body: CreateBatchRequest) -> None:
    if body.endpoint not in ENDPOINTS:
        raise bad_request(f"Invalid endpoint {body.endpoint!r}; supported: "
                          f"{', '.join(ENDPOINTS)}.", "endpoint")
    if body.completion_window != COMPLETION_WINDOW:
        raise bad_request(f"Invalid completion_window {body.completion_window!r}; only "
                          f"{COMPLETION_WINDOW!r} is supported.", "completion_window")
    for key, value in (body.metadata or {}).items():
        if len(key) > 64 or len(value) > 512:
            raise bad_request("metadata keys are at most 64 characters, values at most 512.",
                              "metadata")


async def _start(services: BatchServices, record: BatchRecord) -> None:
    """Send the start task; a broker out of reach fails the batch (and answers 503)."""
    try:
        await services.tasks.send(START_TASK, [record.batch_id])
    except Exception as error:  # noqa: BLE001 - any broker failure: the batch cannot start
        log.error("could not enqueue batch %s: %s", record.batch_id, error)
        errors = [{"code": "queue_unavailable", "message": "The batch queue could not be "
                   "reached; create the batch again.", "param": None, "line": None}]
        await services.batches.transition(record.batch_id, (BatchStatus.VALIDATING,),
                                          BatchStatus.FAILED, errors=json.dumps(errors))
        raise unavailable("the batch queue (Celery broker) cannot be reached",
                          services.pipeline.settings.retry_after_s, "queue_unavailable") \
            from error


async def _own_batch(services: BatchServices, request: Request, batch_id: str) -> BatchRecord:
    tenant = await services.tenant(request)
    record = await services.batches.get_for(batch_id, tenant.tenant_id)
    if record is None:
        raise batch_not_found(batch_id)
    return record
