"""Stored chat completions (OpenAI's `store: true`): GET /v1/chat/completions (a page,
filtered by `model` and `metadata[key]=value`), GET, POST (metadata) and DELETE
/v1/chat/completions/{id}, and GET /v1/chat/completions/{id}/messages; the caller's
tenant's completions only (any other id: 404). Query parameters not listed are refused by
name."""

from __future__ import annotations

import re

from fastapi import APIRouter, Query, Request
from pydantic import Field
from starlette.responses import Response

from conveyor.gateway.api.fields import RequestBody
from conveyor.gateway.api.pages import MAX_LIMIT, PAGE_QUERY, items_page, list_page
from conveyor.gateway.api.schemas import Metadata
from conveyor.gateway.errors import bad_request
from conveyor.gateway.pipeline import Pipeline
from conveyor.gateway.routes import serve_for_tenant

router = APIRouter()

PATH = "/v1/chat/completions/{completion_id}"


class MetadataUpdate(RequestBody):
    metadata: Metadata | None = Field(max_length=16)


def _serve(request: Request, work, served: tuple[str, ...] = ()):
    """`metadata[...]` parameters pass where `metadata` is served (the list's filters)."""
    query = {name: value for name, value in request.query_params.items()
             if not ("metadata" in served and name.startswith("metadata["))}
    return serve_for_tenant(request, "stored_chat_completions", work, query, served)


@router.get("/v1/chat/completions")
async def list_completions(request: Request, after: str | None = None,
                           limit: int = Query(20, ge=1, le=MAX_LIMIT), model: str | None = None,
                           order: str = Query("asc", pattern="^(asc|desc)$")) -> Response:
    """The caller's stored completions, in the order they were stored, filtered by `model`
    and by every `metadata[key]=value` pair given."""
    async def work(pipeline: Pipeline, tenant_id: str) -> dict:
        pairs = _metadata_filter(request)

        def wanted(completion: dict) -> bool:
            metadata = completion.get("metadata") or {}
            return ((model is None or completion["model"] == model)
                    and all(metadata.get(k) == v for k, v in pairs.items()))

        page, more = await pipeline.chat_completions.page(tenant_id, after, limit,
                                                          order == "desc", wanted)
        return list_page(page, more)

    return await _serve(request, work, ("after", "limit", "metadata", "model", "order"))


_METADATA_KEY = re.compile(r"metadata\[([^\[\]]+)\]")


def _metadata_filter(request: Request) -> dict[str, str]:
    """The `metadata[key]=value` pairs of the query; a 400 naming any other `metadata...`
    parameter, or one given twice (as for every parameter)."""
    names = [name for name, _ in request.query_params.multi_items()]
    for name in names:
        if names.count(name) > 1:
            raise bad_request(f"{name} is given more than once", name)
    pairs = {}
    for name, value in request.query_params.items():
        if name.startswith("metadata"):
            match = _METADATA_KEY.fullmatch(name)
            if match is None:
                raise bad_request("metadata filters are sent as metadata[key]=value", name)
            pairs[match.group(1)] = value
    return pairs


@router.get(PATH)
async def retrieve_completion(completion_id: str, request: Request) -> Response:
    return await _serve(request, lambda pipeline, tenant_id: pipeline.chat_completions.get(
        tenant_id, completion_id))


@router.post(PATH)
async def update_completion(completion_id: str, body: MetadataUpdate,
                            request: Request) -> Response:
    return await _serve(request, lambda pipeline, tenant_id: pipeline.chat_completions
                        .update_metadata(tenant_id, completion_id, body.metadata or {}))


@router.delete(PATH)
async def delete_completion(completion_id: str, request: Request) -> Response:
    async def work(pipeline: Pipeline, tenant_id: str) -> dict:
        await pipeline.chat_completions.delete(tenant_id, completion_id)
        return {"id": completion_id, "object": "chat.completion.deleted", "deleted": True}

    return await _serve(request, work)


@router.get(PATH + "/messages")
async def list_messages(completion_id: str, request: Request, after: str | None = None,
                        limit: int = Query(20, ge=1, le=MAX_LIMIT),
                        order: str = Query("asc", pattern="^(asc|desc)$")) -> Response:
    """The messages the completion answered, each with an id (`<completion id>-<place>`)."""
    async def work(pipeline: Pipeline, tenant_id: str) -> dict:
        messages = [_store_message(f"{completion_id}-{i}", m) for i, m in enumerate(
            await pipeline.chat_completions.messages(tenant_id, completion_id))]
        return items_page(messages, after, limit, order)

    return await _serve(request, work, PAGE_QUERY)


def _store_message(message_id: str, message: dict) -> dict:
    """A request message as OpenAI lists a stored completion's: its text as `content`, and
    its text parts as `content_parts` when it was sent as parts (a refusal part's text is
    in `content` only)."""
    content = message.get("content")
    if not isinstance(content, list):
        return {**message, "id": message_id, "content_parts": None}
    text = "".join(p.get("text") or p.get("refusal") or "" for p in content)
    return {**message, "id": message_id, "content": text,
            "content_parts": [p for p in content if p.get("type") == "text"]}
