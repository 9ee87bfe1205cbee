"""The OpenAI Files API: POST/GET /v1/files, GET/DELETE /v1/files/{id}, GET .../content.

A file belongs to the tenant whose key uploaded it; to any other tenant it does
not exist (404). Uploads are streamed to the file store with their own limit
(max_upload_bytes, 200 MB as OpenAI's), never through the JSON body limit.
"""

from __future__ import annotations

from collections.abc import Iterator

from fastapi import APIRouter, Query, Request
from starlette.responses import Response, StreamingResponse

from conveyor.common.file_records import FileRecord, new_file_id, now_s
from conveyor.common.file_store import FileTooLarge
from conveyor.gateway.api.pages import list_page
from conveyor.gateway.batches.batch_services import BatchServices, serve
from conveyor.gateway.batches.multipart_upload import receive_upload
from conveyor.gateway.errors import APIError, bad_request

router = APIRouter()

PURPOSES = ("batch",)
"""Purposes an upload may have (batch output files are `batch_output`)."""
_READ_CHUNK = 64 * 1024


def file_not_found(file_id: str) -> APIError:
    return APIError(404, f"No such File object: {file_id}", "invalid_request_error", "id")


@router.post("/v1/files")
async def upload_file(request: Request) -> Response:
    async def work(services: BatchServices) -> dict:
        tenant = await services.tenant(request)
        file_id = new_file_id()
        settings = services.pipeline.settings
        try:
            upload = await receive_upload(request.headers.get("content-type", ""),
                                          request.stream(), services.files, file_id,
                                          settings.max_upload_bytes)
        except FileTooLarge as error:
            raise APIError(413, f"The file is larger than the limit of {error.max_bytes} "
                           "bytes.", param="file", code="file_too_large") from error
        purpose = upload.fields.get("purpose")
        if purpose not in PURPOSES:
            services.files.delete(file_id)
            raise bad_request(f"Invalid purpose {purpose!r}: this server takes files with "
                              f"purpose {' or '.join(PURPOSES)}.", "purpose")
        record = FileRecord(file_id, tenant.tenant_id, upload.filename or "upload.jsonl",
                            purpose, upload.num_bytes, now_s())
        await services.file_records.add(record)
        return record.to_openai()

    return await serve(request, "files", work)


@router.get("/v1/files")
async def list_files(request: Request, purpose: str | None = None, after: str | None = None,
                     limit: int = Query(10000, ge=1, le=10000),
                     order: str = Query("desc", pattern="^(asc|desc)$")) -> Response:
    async def work(services: BatchServices) -> dict:
        tenant = await services.tenant(request)
        records = await services.file_records.list(
            tenant.tenant_id, purpose=purpose, limit=limit + 1, after=after,
            newest_first=order == "desc")
        return list_page([r.to_openai() for r in records[:limit]], len(records) > limit)

    return await serve(request, "files", work)


@router.get("/v1/files/{file_id}")
async def get_file(file_id: str, request: Request) -> Response:
    async def work(services: BatchServices) -> dict:
        return (await _own_file(services, request, file_id)).to_openai()

    return await serve(request, "files", work)


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, request: Request) -> Response:
    async def work(services: BatchServices) -> Response:
        record = await _own_file(services, request, file_id)
        try:
            file = services.files.open(record.file_id)
        except FileNotFoundError as error:
            raise file_not_found(file_id) from error
        return StreamingResponse(_chunks(file), media_type="application/octet-stream",
                                 headers={"Content-Length": str(record.num_bytes)})

    return await serve(request, "files", work)


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, request: Request) -> Response:
    async def work(services: BatchServices) -> dict:
        tenant = await services.tenant(request)
        if not await services.file_records.delete(file_id, tenant.tenant_id):
            raise file_not_found(file_id)
        services.files.delete(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    return await serve(request, "files", work)


async def _own_file(services: BatchServices, request: Request, file_id: str) -> FileRecord:
    tenant = await services.tenant(request)
    record = await services.file_records.get(file_id, tenant.tenant_id)
    if record is None:
        raise file_not_found(file_id)
    return record


def _chunks(file) -> Iterator[bytes]:
    """The file in pieces (Starlette runs a sync iterator in a thread), then closed."""
    with file:
        while data := file.read(_READ_CHUNK):
            yield data
