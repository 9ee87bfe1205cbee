"""The flow both generation endpoints share (chat and completions).

authenticate -> check model -> tokenize -> admit (quota) -> route to an engine
-> start one generation per choice -> wait for the first output -> stream it
(SSE) or collect it (JSON). The whole handler races the client's disconnect
and the request's deadline; so does the streamed body afterwards. Whatever the
exit (finished, failed, client gone), the admission is settled once and the
request's timeline gets its finish.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial

from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from conveyor.common.engine_registry import EngineEntry
from conveyor.common.log import request_id_var
from conveyor.gateway.assembly import collect_response, stream_payloads
from conveyor.gateway.cancellation import ClientDisconnected, race_client
from conveyor.gateway.choices import ChoiceStreams, started
from conveyor.gateway.engine_records import GenerateJob
from conveyor.gateway.errors import APIError, to_api_error, unavailable
from conveyor.gateway.genai_span import describe_generation, record_usage
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
from conveyor.gateway.tenancy.priority import engine_priority
from conveyor.gateway.tenancy.tenant import Tenant
from conveyor.gateway.tenancy.tenant_admitter import TenantAdmission
from conveyor.gateway.tenancy.timeline import Stage
from conveyor.gateway.timeline_writer import TimelineWriter
from conveyor.gateway.tokenizer_records import PromptTokens
from conveyor.gateway.upstream_error import UpstreamError
from conveyor.gateway.usage_totals import UsageTotals

log = logging.getLogger("conveyor.gateway.requests")

PreparePrompts = Callable[[Pipeline, GenerationBody], Awaitable[list[PromptTokens]]]

ENGINE_HEADER = "x-conveyor-engine"
"""Response header naming the engine (registry id) that served the request."""
SESSION_HEADER = "x-session-id"
"""Request header whose value binds a conversation to one engine (else the body's `user`)."""


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
    """One request in flight: who it is, its deadline, its metrics and timeline, and
    the headers its response (or error) carries."""

    pipeline: Pipeline
    kind: EndpointKind
    body: GenerationBody
    request_id: str
    deadline: float
    record: RequestRecord
    timeline: TimelineWriter
    session_key: str | None
    headers: dict[str, str] = field(default_factory=dict)
    usage: UsageTotals | None = None
    """The usage of the generation under way (None before one started)."""

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
                       pipeline.metrics.start(kind.name),
                       TimelineWriter(pipeline.timelines, request_id),
                       request.headers.get(SESSION_HEADER) or body.user,
                       {"X-Request-Id": request_id})
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
                        headers={**(headers or {}), **error.headers})


@dataclass(slots=True)
class _Admitted:
    """A request that passed every check: its prompts, token budgets and admission."""

    model: ServedModel
    tenant: Tenant
    prompts: list[PromptTokens]
    max_tokens: list[int]
    priority: int
    admission: TenantAdmission


async def _respond(current: _Request, request: Request) -> Response:
    try:
        admitted = await _admit(current, request)
    except BaseException:
        await current.timeline.finish(None, "rejected")  # a no-op before authentication
        raise
    try:
        return await _route_and_generate(current, admitted)
    except BaseException as error:
        await _finish_unserved(current, admitted, error)
        raise


async def _admit(current: _Request, request: Request) -> _Admitted:
    """Caller, model, limits, tokenized prompts, priority and the quota admission."""
    pipeline, body = current.pipeline, current.body
    if pipeline.draining:
        raise unavailable("the gateway is shutting down", pipeline.settings.retry_after_s)
    tenant = await pipeline.admitter.authenticate(request.headers)
    await current.timeline.start(tenant.tenant_id)
    model = await pipeline.catalog.resolve(body.model)
    check_limits(body, model, pipeline.settings.max_n)
    priority = engine_priority(tenant.tier, body.priority)
    prompts = await current.kind.prepare_prompts(pipeline, body)
    max_tokens = [max_tokens_for(body.requested_max_tokens, p, current.kind.prompt_param)
                  for p in prompts]
    num_prompt_tokens = sum(p.num_tokens for p in prompts)
    admission = await pipeline.admitter.admit(tenant, num_prompt_tokens,
                                              sum(max_tokens) * body.n)
    current.headers.update(admission.rate_limit_headers)
    await current.timeline.mark(Stage.ADMITTED, num_prompt_tokens=num_prompt_tokens)
    return _Admitted(model, tenant, prompts, max_tokens, priority, admission)


async def _route_and_generate(current: _Request, admitted: _Admitted) -> Response:
    """Pick an engine and generate there; an engine that cannot be reached is left
    out for a while and the request goes to another one (once)."""
    engine = await _pick(current, admitted)
    try:
        return await _generate(current, admitted, engine)
    except UpstreamError as error:
        if error.service != "engine" or error.code != "UNAVAILABLE":
            raise
        log.warning("engine %s (%s) unreachable, routing around it: %s",
                    engine.engine_id, engine.address, error.message)
        current.pipeline.directory.mark_unreachable(engine.engine_id)
    return await _generate(current, admitted, await _pick(current, admitted))


async def _pick(current: _Request, admitted: _Admitted) -> EngineEntry:
    engine = await current.pipeline.router.pick(
        current.session_key, admitted.prompts[0].token_ids, cache_salt=admitted.tenant.cache_salt)
    current.headers[ENGINE_HEADER] = engine.engine_id
    return engine


async def _generate(current: _Request, admitted: _Admitted, engine: EngineEntry) -> Response:
    """Start every choice, wait for the first output, then stream or collect."""
    pipeline, body = current.pipeline, current.body
    choices = _start_choices(current, engine, admitted)
    await current.timeline.mark(Stage.QUEUED, engine_id=engine.engine_id)
    fmt = current.kind.format(current.request_id, admitted.model.name, num_top_logprobs(body))
    describe_generation(current.kind.name, admitted.model.name, body.requested_max_tokens,
                        current.request_id)
    usage = current.usage = UsageTotals([p.num_tokens for p in admitted.prompts], body.n)
    close = partial(_close, current, choices, admitted.admission, usage)
    try:
        deltas = await started(aiter(choices))
        current.record.first_token()
        await current.timeline.mark(Stage.FIRST_TOKEN)
        if body.stream:
            payloads = stream_payloads(deltas, fmt, len(choices), usage, pipeline.token_texts,
                                       body.include_usage)
            return EventStreamResponse(payloads, current.deadline, current.error_of, close,
                                       current.headers)
        response = await collect_response(deltas, fmt, len(choices), usage, pipeline.token_texts)
    except BaseException:
        await choices.close()
        raise
    await close(200)
    return JSONResponse(response, headers=current.headers)


def _start_choices(current: _Request, engine: EngineEntry,
                   admitted: _Admitted) -> ChoiceStreams:
    """One generation per (prompt, sample); choice index = prompt index * n + sample."""
    body, pipeline = current.body, current.pipeline
    client = pipeline.engines.client(engine.address)
    generations = []
    budgets = zip(admitted.prompts, admitted.max_tokens, strict=True)
    for prompt_index, (prompt, prompt_max_tokens) in enumerate(budgets):
        for sample in range(body.n):
            choice_id = f"{current.request_id}-{prompt_index * body.n + sample}"
            job = GenerateJob(choice_id, prompt.token_ids,
                              sampling_options(body, prompt_max_tokens, sample),
                              admitted.priority, admitted.tenant.cache_salt)
            generations.append(generate(client, pipeline.detok, job,
                                        detok_options(body, choice_id, prompt)))
    return ChoiceStreams(generations)


@dataclass(slots=True, frozen=True)
class _Spent:
    """What a request is charged for its output (TenantAdmission.settle's argument)."""

    completion_tokens: int


async def _close(current: _Request, choices: ChoiceStreams, admission: TenantAdmission,
                 usage: UsageTotals, status: int) -> None:
    """The response is over (sent, failed mid-stream, or its client went away)."""
    await choices.close()
    current.record.tokens(usage)
    current.record.finish(status)
    if status == DISCONNECTED_STATUS:
        log.info("client went away mid-stream; generation cancelled")
    reason = usage.finish_reason if status == 200 else _unfinished_reason(status)
    record_usage(usage, reason or "unknown", current.headers.get(ENGINE_HEADER))
    await _settle(admission, _Spent(usage.num_tokens_spent))
    await current.timeline.finish(usage, reason or "unknown")


async def _finish_unserved(current: _Request, admitted: _Admitted, error: BaseException) -> None:
    """No response was started: return the quota (all of it if nothing was produced)."""
    usage = current.usage if current.usage and current.usage.num_tokens_seen else None
    await _settle(admitted.admission, None if usage is None else _Spent(usage.num_tokens_spent))
    gone = isinstance(error, asyncio.CancelledError | ClientDisconnected)
    await current.timeline.finish(usage, "cancelled" if gone else "error")


async def _settle(admission: TenantAdmission, spent: _Spent | None) -> None:
    try:
        await admission.settle(spent)
    except RedisError as error:  # the reservation's lease frees it later
        log.warning("could not settle the admission: %s", error)


def _unfinished_reason(status: int) -> str:
    return "cancelled" if status == DISCONNECTED_STATUS else "error"
