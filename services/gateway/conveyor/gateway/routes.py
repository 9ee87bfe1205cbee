"""The HTTP endpoints. Each is thin: the work lives in the modules it calls."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Request
from redis.exceptions import RedisError
from starlette.responses import JSONResponse, Response

from conveyor.gateway.api_models import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    chat_turns,
)
from conveyor.gateway.errors import error_response, to_api_error
from conveyor.gateway.generation_request import CHAT, COMPLETIONS
from conveyor.gateway.pipeline import Pipeline
from conveyor.gateway.response_stream import GenerationResponse
from conveyor.gateway.wire import PromptInput, RenderInput

router = APIRouter()


def _pipeline(request: Request) -> Pipeline:
    return request.app.state.pipeline


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return GenerationResponse(_pipeline(request), request, body, CHAT)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    return GenerationResponse(_pipeline(request), request, body, COMPLETIONS)


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    async def work(pipeline: Pipeline) -> dict:
        model = await pipeline.catalog.model()
        return {"object": "list", "data": [{
            "id": model.name, "object": "model", "created": int(time.time()),
            "owned_by": "conveyor", "root": model.name, "max_model_len": model.max_model_len,
        }]}

    return await _serve_simple(request, "models", work)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    async def work(pipeline: Pipeline) -> dict:
        model = await pipeline.catalog.resolve(body.model)
        if body.messages is not None:
            prompt = await pipeline.tokenizer.render(RenderInput(
                chat_turns(body.messages), add_generation_prompt=body.add_generation_prompt))
        else:
            prompt = await pipeline.tokenizer.tokenize(PromptInput(
                text=body.prompt, add_special_tokens=body.add_special_tokens))
        return {"count": prompt.num_tokens, "max_model_len": model.max_model_len,
                "tokens": prompt.token_ids}

    return await _serve_simple(request, "tokenize", work, prompt_param="prompt")


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
    async def work(pipeline: Pipeline) -> dict:
        await pipeline.catalog.resolve(body.model)
        return {"prompt": await pipeline.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    return await _serve_simple(request, "detokenize", work, prompt_param="tokens")


@router.get("/v1/requests/{request_id}")
async def request_timeline(request_id: str, request: Request) -> Response:
    """A request's timeline (stages, tokens, engine), readable by its tenant only."""
    async def work(pipeline: Pipeline) -> dict:
        tenant = await pipeline.admitter.authenticate(request.headers)
        timeline = await pipeline.timelines.get(request_id, tenant.tenant_id)
        return {"object": "request.timeline", **timeline.to_dict()}

    return await _serve_simple(request, "requests", work)


@router.get("/health")
async def health(request: Request) -> Response:
    """503 while draining or while Redis, every engine, the tokenizer or detok is down."""
    pipeline = _pipeline(request)
    if pipeline.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    engines, redis_up, tokenizer_up, detok_up = await asyncio.gather(
        _num_live_engines(pipeline), _redis_up(pipeline), pipeline.tokenizer.is_serving(),
        pipeline.detok.is_serving())
    down = [name for name, up in (("redis", redis_up), ("engine", bool(engines)),
                                  ("tokenizer", tokenizer_up), ("detok", detok_up)) if not up]
    if down:
        return JSONResponse({"status": "unavailable", "down": down}, status_code=503)
    return JSONResponse({"status": "ok", "num_engines": engines})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    registry = _pipeline(request).metrics
    return Response(registry.render(), media_type=registry.content_type)


async def _num_live_engines(pipeline: Pipeline) -> int:
    try:
        return len(await pipeline.directory.list_live())
    except RedisError:
        return 0


async def _redis_up(pipeline: Pipeline) -> bool:
    try:
        return bool(await pipeline.redis.ping())
    except RedisError:
        return False


async def _serve_simple(request: Request, endpoint: str,
                        work: Callable[[Pipeline], Awaitable[dict]],
                        prompt_param: str | None = None) -> Response:
    """A unary endpoint: its metrics, and any failure as an OpenAI error body."""
    pipeline = _pipeline(request)
    record = pipeline.metrics.start(endpoint)
    try:
        response = JSONResponse(await work(pipeline))
    except Exception as error:  # noqa: BLE001 - every failure becomes an OpenAI error body
        api_error = to_api_error(error, prompt_param, pipeline.settings.retry_after_s)
        record.finish(api_error.status)
        return error_response(api_error)
    record.finish(200)
    return response
