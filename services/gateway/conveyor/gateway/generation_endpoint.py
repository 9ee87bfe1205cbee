"""The flow both generation endpoints share (chat and completions).

check model -> authenticate -> tokenize -> admit -> pick an engine -> start one
generation per choice -> wait for the first output -> stream it (SSE) or
collect it (JSON). The whole handler races the client's disconnect and the
request's deadline; so does the streamed body afterwards.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from conveyor.common.log import request_id_var
from conveyor.gateway.admission import Admission, Caller
from conveyor.gateway.assembly import collect_response, stream_payloads
from conveyor.gateway.cancellation import ClientDisconnected, race_client
from conveyor.gateway.choices import ChoiceStreams, started
from conveyor.gateway.engine_client import EngineClient
from conveyor.gateway.engine_records import GenerateJob
from conveyor.gateway.errors import APIError, to_api_error, unavailable
from conveyor.gateway.generation import generate
from conveyor.gateway.metrics import DISCONNECTED_STATUS, RequestRecord
from conveyor.gateway.model_catalog import ServedModel
from conveyor.gateway.pipeline import Pipeline
from conveyor.gateway.request_mapping import (
    GenerationBody,
    check_limits,
    detok_options,
    max_tokens_for,
    num_top_logprobs,
    sampling_options,
)
from conveyor.gateway.response_formats import ResponseFormat
from conveyor.gateway.sse import EventStreamResponse
from conveyor.gateway.tokenizer_records import PromptTokens
from conveyor.gateway.usage_totals import UsageTotals

log = logging.getLogger("conveyor.gateway.requests")

PreparePrompts = Callable[[Pipeline, GenerationBody], Awaitable[list[PromptTokens]]]


@dataclass(frozen=True, slots=True)
class EndpointKind:
    """What differs between chat and completions."""

    name: str
    id_prefix: str
    prompt_param: str
    format: type[ResponseFormat]
    prepare_prompts: PreparePrompts


@dataclass(slots=True)
class _Request:
    """One request in flight: who it is, its deadline and how its metrics end."""

    pipeline: Pipeline
    kind: EndpointKind
    body: GenerationBody
    request_id: str
    deadline: float
    record: RequestRecord

    @property
    def headers(self) -> dict[str, str]:
        return {"X-Request-Id": self.request_id}

    def error_of(self, error: BaseException) -> APIError:
        return to_api_error(error, self.kind.prompt_param,
                            self.pipeline.settings.retry_after_s)


async def serve_generation(pipeline: Pipeline, request: Request, body: GenerationBody,
                           kind: EndpointKind) -> Response:
    """Serve one chat or completions request."""
    request_id = f"{kind.id_prefix}-{uuid.uuid4().hex}"
    request_id_var.set(request_id)
    loop = asyncio.get_running_loop()
    current = _Request(pipeline, kind, body, request_id,
                       loop.time() + pipeline.settings.request_timeout_s,
                       pipeline.metrics.start(kind.name))
    try:
        return await race_client(_respond(current, request), request.receive, current.deadline)
    except ClientDisconnected:
        log.info("client went away before the response started")
        current.record.finish(DISCONNECTED_STATUS)
        return Response(status_code=DISCONNECTED_STATUS)
    except Exception as error:  # noqa: BLE001 - every failure becomes an OpenAI error body
        api_error = current.error_of(error)
        current.record.finish(api_error.status)
        return error_response(api_error, current.headers)


def error_response(error: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status,
                        headers={**error.headers, **(headers or {})})


@dataclass(slots=True)
class _Admitted:
    """A request that passed every check: its prompts, token budgets and admission."""

    model: ServedModel
    caller: Caller
    prompts: list[PromptTokens]
    max_tokens: list[int]
    admission: Admission


async def _respond(current: _Request, request: Request) -> Response:
    admitted = await _admit(current, request)
    try:
        engine = await current.pipeline.picker.pick()
    except BaseException:
        await admitted.admission.settle(None)
        raise
    return await _generate(current, admitted, engine)


async def _admit(current: _Request, request: Request) -> _Admitted:
    """Model, limits, caller, tokenized prompts and the quota admission."""
    pipeline, body = current.pipeline, current.body
    if pipeline.draining:
        raise unavailable("the gateway is shutting down", pipeline.settings.retry_after_s)
    model = await pipeline.catalog.resolve(body.model)
    check_limits(body, model, pipeline.settings.max_n)
    caller = await pipeline.admitter.authenticate(request.headers)
    prompts = await current.kind.prepare_prompts(pipeline, body)
    max_tokens = [max_tokens_for(body.requested_max_tokens, p, current.kind.prompt_param)
                  for p in prompts]
    admission = await pipeline.admitter.admit(
        caller, sum(p.num_tokens for p in prompts), sum(max_tokens) * body.n)
    return _Admitted(model, caller, prompts, max_tokens, admission)


async def _generate(current: _Request, admitted: _Admitted, engine: EngineClient) -> Response:
    """Start every choice, wait for the first output, then stream or collect."""
    pipeline, body = current.pipeline, current.body
    choices = _start_choices(current, engine, admitted)
    fmt = current.kind.format(current.request_id, admitted.model.name, num_top_logprobs(body))
    usage = UsageTotals([p.num_tokens for p in admitted.prompts], body.n)
    close = partial(_close, current, choices, admitted.admission, usage)
    try:
        deltas = await started(aiter(choices))
        current.record.first_token()
        if body.stream:
            payloads = stream_payloads(deltas, fmt, len(choices), usage, pipeline.token_texts,
                                       body.include_usage)
            return EventStreamResponse(payloads, current.deadline, current.error_of, close,
                                       current.headers)
        response = await collect_response(deltas, fmt, len(choices), usage, pipeline.token_texts)
    except BaseException:
        await choices.close()
        await admitted.admission.settle(None)
        raise
    await close(200)
    return JSONResponse(response, headers=current.headers)


def _start_choices(current: _Request, engine: EngineClient,
                   admitted: _Admitted) -> ChoiceStreams:
    """One generation per (prompt, sample); choice index = prompt index * n + sample."""
    body, pipeline = current.body, current.pipeline
    generations = []
    budgets = zip(admitted.prompts, admitted.max_tokens, strict=True)
    for prompt_index, (prompt, prompt_max_tokens) in enumerate(budgets):
        for sample in range(body.n):
            choice_id = f"{current.request_id}-{prompt_index * body.n + sample}"
            job = GenerateJob(choice_id, prompt.token_ids,
                              sampling_options(body, prompt_max_tokens, sample),
                              body.priority, admitted.caller.cache_salt)
            generations.append(generate(engine, pipeline.detok, job,
                                        detok_options(body, choice_id, prompt)))
    return ChoiceStreams(generations)


async def _close(current: _Request, choices: ChoiceStreams, admission: Admission,
                 usage: UsageTotals, status: int) -> None:
    await choices.close()
    current.record.tokens(usage)
    current.record.finish(status)
    await admission.settle(usage)
    if status == DISCONNECTED_STATUS:
        log.info("client went away mid-stream; generation cancelled")
