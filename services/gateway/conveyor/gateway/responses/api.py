"""POST /v1/responses (served on the generation path, as chat requests are, or in the
background: background.py), GET /v1/responses/{id}, GET /v1/responses/{id}/input_items,
POST /v1/responses/{id}/cancel and DELETE /v1/responses/{id} (the caller's stored
responses)."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request
from pydantic import ValidationError
from starlette.responses import Response, StreamingResponse

from conveyor.gateway.api.pages import MAX_LIMIT, items_page, refuse_unserved_query
from conveyor.gateway.errors import bad_request, error_response
from conveyor.gateway.pipeline import Pipeline
from conveyor.gateway.response_writer import SSE_HEADERS
from conveyor.gateway.responses.background import BackgroundResponses
from conveyor.gateway.responses.conversation import chat_request
from conveyor.gateway.responses.endpoint import RESPONSES
from conveyor.gateway.responses.input_items import input_items
from conveyor.gateway.responses.request_body import ResponsesRequest
from conveyor.gateway.routes import GenerationResponse, pipeline_of, serve_simple
from conveyor.gateway.validation_errors import validation_error

router = APIRouter()


def background_of(request: Request) -> BackgroundResponses:
    return request.app.state.background


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    try:
        chat = chat_request(body)
    except ValidationError as error:  # a value chat refuses that the Responses body let by
        return error_response(validation_error(error.errors()))
    if not body.background:
        return GenerationResponse(pipeline_of(request), request.headers, chat, RESPONSES)

    async def work(pipeline: Pipeline) -> dict | Response:
        tenant_id, response = await background_of(request).start(pipeline, request.headers,
                                                                  chat)
        return _events(request, tenant_id, response["id"], -1) if chat.stream else response

    return await serve_simple(request, "responses", work)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request, stream: bool = False,
                            starting_after: int | None = Query(None, ge=0)) -> Response:
    """A stored response of the caller's tenant (404 for any other); with `stream`, a
    streamed background response's events again (after `starting_after`)."""
    async def work(pipeline: Pipeline) -> dict | Response:
        refuse_unserved_query(request.query_params, ("stream", "starting_after"))
        if starting_after is not None and not stream:
            raise bad_request("starting_after is only allowed when stream is true",
                              "starting_after")
        tenant = await pipeline.admitter.authenticate(request.headers)
        if not stream:
            return (await pipeline.responses.get(tenant.tenant_id, response_id)).response
        await background_of(request).check_streamed(tenant.tenant_id, response_id)
        after = -1 if starting_after is None else starting_after
        return _events(request, tenant.tenant_id, response_id, after)

    return await serve_simple(request, "responses", work)


def _events(request: Request, tenant_id: str, response_id: str,
            after: int) -> StreamingResponse:
    """A streamed background response's events after `after`, as they come."""
    return StreamingResponse(background_of(request).events(tenant_id, response_id, after),
                             media_type="text/event-stream", headers=SSE_HEADERS)


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(response_id: str, request: Request, after: str | None = None,
                           limit: int = Query(20, ge=1, le=MAX_LIMIT),
                           order: str = Query("desc", pattern="^(asc|desc)$")) -> Response:
    """A page of the items a stored response of the caller's tenant was generated from."""
    async def work(pipeline: Pipeline) -> dict:
        refuse_unserved_query(request.query_params)
        tenant = await pipeline.admitter.authenticate(request.headers)
        stored = await pipeline.responses.get(tenant.tenant_id, response_id)
        return items_page(input_items(stored), after, limit, order)

    return await serve_simple(request, "responses", work)


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, request: Request) -> Response:
    """Cancel a background response of the caller's tenant that is still running."""
    async def work(pipeline: Pipeline) -> dict:
        tenant = await pipeline.admitter.authenticate(request.headers)
        return await background_of(request).cancel(tenant.tenant_id, response_id)

    return await serve_simple(request, "responses", work)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> Response:
    async def work(pipeline: Pipeline) -> dict:
        tenant = await pipeline.admitter.authenticate(request.headers)
        await pipeline.responses.delete(tenant.tenant_id, response_id)
        background_of(request).end_here(tenant.tenant_id, response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return await serve_simple(request, "responses", work)
