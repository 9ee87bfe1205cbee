"""The Conversations API: POST /v1/conversations, GET, POST (metadata) and DELETE
/v1/conversations/{id}, and its items: POST and GET /v1/conversations/{id}/items, GET and
DELETE /v1/conversations/{id}/items/{item_id}; the caller's tenant's conversations only
(any other id: 404). A Responses request names one with `conversation` (conversation.py).

Items are what the Responses API takes as input (messages of text, function calls and
their outputs; items.py keeps them); `include`, and any other query parameter not listed
here, is refused by name.
"""

from __future__ import annotations

from fastapi import APIRouter, Query, Request
from pydantic import Field
from starlette.responses import Response

from conveyor.gateway.api.fields import RequestBody
from conveyor.gateway.api.pages import MAX_LIMIT, PAGE_QUERY, items_page, list_page
from conveyor.gateway.api.schemas import Metadata
from conveyor.gateway.pipeline import Pipeline
from conveyor.gateway.responses.items import kept_items
from conveyor.gateway.responses.request_body import InputItem
from conveyor.gateway.routes import serve_for_tenant

router = APIRouter()

MAX_ITEMS_ADDED = 20
"""Items one call may add (OpenAI's bound)."""

class ConversationCreate(RequestBody):
    items: list[InputItem] | None = Field(None, max_length=MAX_ITEMS_ADDED)
    metadata: Metadata | None = Field(None, max_length=16)  # as a request's


class ConversationUpdate(RequestBody):
    metadata: Metadata | None = Field(max_length=16)


class ItemsCreate(RequestBody):
    items: list[InputItem] = Field(min_length=1, max_length=MAX_ITEMS_ADDED)


def _serve(request: Request, work, served: tuple[str, ...] = ()):
    return serve_for_tenant(request, "conversations", work, served=served)


@router.post("/v1/conversations")
async def create_conversation(body: ConversationCreate, request: Request) -> Response:
    return await _serve(request, lambda pipeline, tenant_id: pipeline.conversations.create(
        tenant_id, body.metadata or {}, kept_items(body.items or [])))


@router.get("/v1/conversations/{conversation_id}")
async def retrieve_conversation(conversation_id: str, request: Request) -> Response:
    return await _serve(request, lambda pipeline, tenant_id: pipeline.conversations.get(
        tenant_id, conversation_id))


@router.post("/v1/conversations/{conversation_id}")
async def update_conversation(conversation_id: str, body: ConversationUpdate,
                              request: Request) -> Response:
    return await _serve(request, lambda pipeline, tenant_id: pipeline.conversations.update(
        tenant_id, conversation_id, body.metadata or {}))


@router.delete("/v1/conversations/{conversation_id}")
async def delete_conversation(conversation_id: str, request: Request) -> Response:
    async def work(pipeline: Pipeline, tenant_id: str) -> dict:
        await pipeline.conversations.delete(tenant_id, conversation_id)
        return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}

    return await _serve(request, work)


@router.post("/v1/conversations/{conversation_id}/items")
async def create_items(conversation_id: str, body: ItemsCreate, request: Request) -> Response:
    async def work(pipeline: Pipeline, tenant_id: str) -> dict:
        items = kept_items(body.items)
        await pipeline.conversations.add(tenant_id, conversation_id, items)
        return list_page(items, False)

    return await _serve(request, work)


@router.get("/v1/conversations/{conversation_id}/items")
async def list_items(conversation_id: str, request: Request, after: str | None = None,
                     limit: int = Query(20, ge=1, le=MAX_LIMIT),
                     order: str = Query("desc", pattern="^(asc|desc)$")) -> Response:
    async def work(pipeline: Pipeline, tenant_id: str) -> dict:
        items = await pipeline.conversations.items(tenant_id, conversation_id)
        return items_page(items, after, limit, order)

    return await _serve(request, work, PAGE_QUERY)


@router.get("/v1/conversations/{conversation_id}/items/{item_id}")
async def retrieve_item(conversation_id: str, item_id: str, request: Request) -> Response:
    return await _serve(request, lambda pipeline, tenant_id: pipeline.conversations.item(
        tenant_id, conversation_id, item_id))


@router.delete("/v1/conversations/{conversation_id}/items/{item_id}")
async def delete_item(conversation_id: str, item_id: str, request: Request) -> Response:
    async def work(pipeline: Pipeline, tenant_id: str) -> dict:
        await pipeline.conversations.delete_item(tenant_id, conversation_id, item_id)
        return await pipeline.conversations.get(tenant_id, conversation_id)

    return await _serve(request, work)
