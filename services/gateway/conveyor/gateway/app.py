"""The FastAPI application: routes, error handlers, and the pipeline's lifetime."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

from conveyor.gateway.api.body_limit import BodySizeLimitMiddleware
from conveyor.gateway.batches.api import router as batches_router
from conveyor.gateway.batches.batch_metrics import attach_batch_metrics
from conveyor.gateway.errors import APIError, error_response, internal_error
from conveyor.gateway.lora.api import router as lora_router
from conveyor.gateway.observability import RequestSpanMiddleware
from conveyor.gateway.pipeline import Pipeline
from conveyor.gateway.probes import router as probes_router
from conveyor.gateway.responses.api import router as responses_router
from conveyor.gateway.responses.background import BackgroundResponses
from conveyor.gateway.responses.conversations_api import router as conversations_router
from conveyor.gateway.routes import router
from conveyor.gateway.settings import GatewaySettings
from conveyor.gateway.stored_chat.api import router as stored_chat_router
from conveyor.gateway.validation_errors import validation_error

log = logging.getLogger("conveyor.gateway")


def create_app(settings: GatewaySettings) -> FastAPI:
    """The gateway app; its pipeline (gRPC channels) opens at startup and closes at shutdown,
    after the background responses still running (cancelled then)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.pipeline = pipeline = Pipeline.connect(settings)
        app.state.background = BackgroundResponses(
            pipeline.responses, settings.responses_lease_s,
            poll_s=min(0.25, settings.redis_timeout_s / 4))
        attach_batch_metrics(pipeline)
        try:
            yield
        finally:
            await app.state.background.close()
            await pipeline.close()

    app = FastAPI(title="Conveyor", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.include_router(router)
    app.include_router(probes_router)
    app.include_router(batches_router)
    app.include_router(responses_router)
    app.include_router(conversations_router)
    app.include_router(stored_chat_router)
    app.include_router(lora_router)
    app.add_middleware(RequestSpanMiddleware)
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=settings.max_body_bytes,
                       exempt_paths=("/v1/files",))  # uploads: their own limit
    _add_error_handlers(app)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        error = validation_error(exc.errors())
        _count(request, error.status)
        return error_response(error)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, exc: HTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = str(exc.detail)
        if exc.status_code in (404, 405):  # no such route, or not with this method
            message = f"Invalid URL ({request.method} {request.url.path}): {message}"
        return error_response(APIError(exc.status_code, message, kind),
                              dict(exc.headers or {}))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error on %s", request.url.path, exc_info=exc)
        return error_response(internal_error())


def _count(request: Request, status: int) -> None:
    """Requests rejected before reaching a handler still show in the request counter."""
    pipeline: Pipeline | None = getattr(request.app.state, "pipeline", None)
    if pipeline is not None:
        pipeline.metrics.start(request.url.path).finish(status)
