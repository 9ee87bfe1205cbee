"""The HTTP endpoints, and the response of a generation request, which runs the request
and writes its bytes.

The endpoints are thin: the work lives in the modules they call. The two generation
routes return a `GenerationResponse`.

`GenerationResponse` is the ASGI response the two generation routes return. Its call
is the request's whole life, in the one task the ASGI server gave it:

    async with GenerationRequest(...) as request, Lifeline(receive, deadline):
        admit -> start (first delta) -> stream SSE events, or collect one JSON body

The last bytes of a response go out after the request released what it held, so a
client that sends its next request at once finds its quota and slot returned.

The `Lifeline` watches the client's connection (the ASGI `http.disconnect`, awaited,
never polled) and the deadline; when either ends the request it cancels the task once
and remembers why, and the request's own checks raise that reason at the next stage
or delta, in case a library swallowed the cancellation. What the request holds is
released by GenerationRequest's exit, never here: the response's bytes are written by
response_writer.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping

from fastapi import APIRouter, Request
from redis.exceptions import RedisError
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from conveyor.gateway.api.mapping import GenerationBody, conversation_input
from conveyor.gateway.api.pages import refuse_unserved_query
from conveyor.gateway.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from conveyor.gateway.clients.tokenizer import PromptInput
from conveyor.gateway.endpoints import CHAT, COMPLETIONS, EndpointKind
from conveyor.gateway.errors import (
    ClientDisconnected,
    RequestTimedOut,
    error_response,
    to_api_error,
)
from conveyor.gateway.generation_request import GenerationRequest
from conveyor.gateway.models import ServedModel
from conveyor.gateway.pipeline import Pipeline
from conveyor.gateway.response_writer import ResponseWriter

# -- response -------------------------------------------------------------------------------


class Lifeline:
    """Ends a request when its client disconnects or its deadline passes: cancels the
    request's task once and keeps the reason for `check`."""

    def __init__(self, receive: Receive, deadline: float):
        self._receive = receive
        self._deadline = deadline
        self.ended_by: Exception | None = None

    async def __aenter__(self) -> Lifeline:
        loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._watcher = asyncio.create_task(self._watch())
        self._timer = loop.call_at(self._deadline, self._end, RequestTimedOut())
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        self._timer.cancel()
        self._watcher.cancel()
        await asyncio.gather(self._watcher, return_exceptions=True)
        if self.ended_by is not None:
            await _absorb_cancellation()

    def check(self) -> None:
        if self.ended_by is not None:
            raise self.ended_by

    async def _watch(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self._end(ClientDisconnected())

    def _end(self, reason: Exception) -> None:
        if self.ended_by is None:
            self.ended_by = reason
            self._task.cancel()


async def _absorb_cancellation() -> None:
    """Take back the lifeline's cancel: raised here if still pending, then uncounted."""
    try:
        await asyncio.sleep(0)
    except asyncio.CancelledError:
        pass
    task = asyncio.current_task()
    while task.cancelling():
        task.uncancel()


class GenerationResponse(Response):
    """Serves one generation request (see the module doc); `admitted` is set once the
    request is admitted (a background response's creation waits for it)."""

    def __init__(self, pipeline: Pipeline, headers: Mapping[str, str], body: GenerationBody,
                 kind: EndpointKind, request_id: str | None = None,
                 admitted: asyncio.Event | None = None):
        self.status_code = 200
        self.background = None
        self._pipeline, self._headers, self._body, self._kind = pipeline, headers, body, kind
        self._request_id, self._admitted = request_id, admitted or asyncio.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with GenerationRequest(self._pipeline, self._kind, self._body, self._headers,
                                     self._request_id) as request:
            writer = ResponseWriter(send, request, self._admitted)
            failure = await _serve_watched(writer, receive)
            if failure is None:
                request.end(None)
            else:
                await writer.fail(failure)
        await writer.send_last()  # once released, so the client's next request finds it so


async def _serve_watched(writer: ResponseWriter, receive: Receive) -> Exception | None:
    """Serve the request under its lifeline; what ended it early, or None."""
    request = writer.request
    async with Lifeline(receive, request.deadline) as lifeline:
        request.check = lifeline.check
        try:
            await writer.serve()
        except asyncio.CancelledError:
            if lifeline.ended_by is None:
                raise  # a real cancellation (shutdown): the request's exit releases
            return lifeline.ended_by
        except Exception as error:  # noqa: BLE001 - every failure ends as a response
            return error
    return None


# -- routes ------------------------------------------------------------------------------

router = APIRouter()


def pipeline_of(request: Request) -> Pipeline:
    return request.app.state.pipeline


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return GenerationResponse(pipeline_of(request), request.headers, body, CHAT)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    return GenerationResponse(pipeline_of(request), request.headers, body, COMPLETIONS)


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    """The served model, then the LoRA adapters the caller may use."""
    async def work(pipeline: Pipeline) -> dict:
        models = await pipeline.catalog.models(await viewer_of(pipeline, request))
        return {"object": "list", "data": [model_card(m) for m in models]}

    return await serve_simple(request, "models", work)


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> Response:
    """The model's card (as in the list), or 404 model_not_found."""
    async def work(pipeline: Pipeline) -> dict:
        return model_card(await pipeline.catalog.resolve(model_id,
                                                         await viewer_of(pipeline, request)))

    return await serve_simple(request, "models", work)


async def viewer_of(pipeline: Pipeline, request: Request) -> str | None:
    """The tenant whose models a caller of the model endpoints sees: its key's (401 for a
    wrong one), the anonymous tenant when keys are off, and None (public models only)
    for a caller without a key, as these endpoints answered before models had owners."""
    if pipeline.admitter.auth_enabled and "authorization" not in request.headers:
        return None
    return (await pipeline.admitter.authenticate(request.headers)).tenant_id


def model_card(model: ServedModel) -> dict:
    """vLLM's model card: OpenAI's fields, root (an adapter's folder), parent (an
    adapter's base model) and max_model_len."""
    root = model.name if model.lora is None else model.lora.path
    return {"id": model.name, "object": "model", "created": int(time.time()),
            "owned_by": "conveyor", "root": root, "parent": model.parent,
            "max_model_len": model.max_model_len}


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    async def work(pipeline: Pipeline) -> dict:
        model = await pipeline.catalog.resolve(body.model, await viewer_of(pipeline, request))
        if body.messages is not None:
            prompt = await pipeline.tokenizer.render(conversation_input(body, model))
        else:
            prompt = await pipeline.tokenizer.tokenize(PromptInput(
                text=body.prompt, add_special_tokens=body.add_special_tokens,
                max_model_len=model.max_model_len))
        strings = await pipeline.tokenizer.token_strings(prompt.token_ids) \
            if body.return_token_strs else None
        return {"count": prompt.num_tokens, "max_model_len": model.max_model_len,
                "tokens": prompt.token_ids, "token_strs": strings}

    return await serve_simple(request, "tokenize", work, prompt_param="prompt")


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
    async def work(pipeline: Pipeline) -> dict:
        await pipeline.catalog.resolve(body.model, await viewer_of(pipeline, request))
        return {"prompt": await pipeline.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    return await serve_simple(request, "detokenize", work, prompt_param="tokens")


@router.get("/v1/requests/{request_id}")
async def request_timeline(request_id: str, request: Request) -> Response:
    """A request's timeline (stages, tokens, engine), readable by its tenant only."""
    async def work(pipeline: Pipeline) -> dict:
        tenant = await pipeline.admitter.authenticate(request.headers)
        timeline = await pipeline.timelines.get(request_id, tenant.tenant_id)
        return {"object": "request.timeline", **timeline.to_dict()}

    return await serve_simple(request, "requests", work)


@router.get("/health")
async def health(request: Request) -> Response:
    """503 while draining or while Redis, every engine, the tokenizer or detok is down."""
    pipeline = pipeline_of(request)
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
    registry = pipeline_of(request).metrics
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


async def serve_for_tenant(request: Request, endpoint: str,
                           work: Callable[[Pipeline, str], Awaitable[dict | Response]],
                           query: Mapping[str, str] | None = None,
                           served: tuple[str, ...] = ()) -> Response:
    """A unary endpoint of the caller's tenant (serve_simple): `work(pipeline, tenant_id)`
    once authenticated; a parameter of `query` (default: the request's) not `served` is
    refused by name first."""
    async def authenticated(pipeline: Pipeline) -> dict | Response:
        refuse_unserved_query(request.query_params if query is None else query, served)
        tenant = await pipeline.admitter.authenticate(request.headers)
        return await work(pipeline, tenant.tenant_id)

    return await serve_simple(request, endpoint, authenticated)


async def serve_simple(request: Request, endpoint: str,
                        work: Callable[[Pipeline], Awaitable[dict | Response]],
                        prompt_param: str | None = None) -> Response:
    """A unary endpoint (its work's dict as JSON, or its response): its metrics, and any
    failure as an OpenAI error body."""
    pipeline = pipeline_of(request)
    record = pipeline.metrics.start(endpoint)
    try:
        result = await work(pipeline)
        response = result if isinstance(result, Response) else JSONResponse(result)
    except Exception as error:  # noqa: BLE001 - every failure becomes an OpenAI error body
        api_error = to_api_error(error, prompt_param, pipeline.settings.retry_after_s)
        record.finish(api_error.status)
        return error_response(api_error)
    record.finish(200)
    return response
