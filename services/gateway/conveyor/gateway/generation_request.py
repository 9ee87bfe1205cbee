"""One generation request (chat, completions, or the Responses API, served as a chat
request: responses/), the one object that owns what it acquires.

`async with GenerationRequest(...) as request:` is the request's life. Everything it
acquires is registered for release in the same step as it is acquired (the release
registered first where the acquisition itself could be lost to a cancellation), on
one exit stack that unwinds on every way out (finished, stop string, client gone,
deadline, shutdown, error, a cancellation some library swallowed), shielded from a
second cancellation:

    acquired                       released (in this order on the way out)
    choice streams (detok+engine)  cancelled (detok cancels the engine's call)
    quota reservation              settled: unused tokens and the concurrency slot back
    timeline                       saved with its end state (finished, cancelled, ...)
    routing bindings               written (a new session's engine, prefix hints)
    its kind's end writes           written, if it was served whole (a stored response)
    metrics record, GenAI span     finished with the status and usage

Settling, the timeline's end, the bindings and a stored response are one Redis round
trip; with the admission (its timeline start inside) and the routing read that makes
three per request, two before the first byte (docs/deployment.md, "Redis round
trips"); a Responses request continuing a stored one reads it once more.

The stages, in order: `admit` (caller, model, limits, prompts, quota), `start`
(route, open one choice per prompt and sample, wait for the first delta), then
`next_delta` until None. Between stages, and before each delta, `check` raises if the
client went away or the deadline passed, so a swallowed cancellation costs at most
one stage, never a release.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any, TypeVar

from redis.exceptions import RedisError

from conveyor.common.engine_registry import EngineEntry
from conveyor.common.errors import QUEUE_FULL
from conveyor.common.log import request_id_var
from conveyor.common.redis_scripts import run_script_calls
from conveyor.gateway.api.mapping import (
    GenerationBody,
    check_limits,
    detok_options,
    max_tokens_for,
    sampling_options,
)
from conveyor.gateway.clients.detok import DetokOptions, GenerationDelta, ToolCallFormat
from conveyor.gateway.clients.engine import GenerateJob
from conveyor.gateway.clients.tokenizer import PromptTokens
from conveyor.gateway.clients.upstream import UpstreamError
from conveyor.gateway.endpoints import EndpointKind
from conveyor.gateway.errors import (
    APIError,
    ClientDisconnected,
    RequestTimedOut,
    to_api_error,
    unavailable,
)
from conveyor.gateway.generation import ChoiceStreams, Target
from conveyor.gateway.models import ServedModel
from conveyor.gateway.observability import DISCONNECTED_STATUS, describe_generation, record_usage
from conveyor.gateway.output_constraints import OutputPlan, output_plan
from conveyor.gateway.pipeline import Pipeline
from conveyor.gateway.response_formats import ResponseFormat
from conveyor.gateway.routing.bindings import PendingBindings
from conveyor.gateway.routing.directory import NoEngineAvailable
from conveyor.gateway.routing.router import AdaptersNotServed
from conveyor.gateway.tenancy.admission import TenantAdmission, engine_priority
from conveyor.gateway.tenancy.api_keys import Tenant
from conveyor.gateway.tenancy.timeline import Stage, TimelineDraft, TimelineWrite
from conveyor.gateway.usage_totals import UsageTotals

log = logging.getLogger("conveyor.gateway.requests")


T = TypeVar("T")


ENGINE_HEADER = "x-conveyor-engine"
"""Response header naming the engine (registry id) that served the request."""


SESSION_HEADER = "x-session-id"
"""Request header whose value binds a conversation to one engine (else the body's
`prompt_cache_key`, else its `user`)."""


@dataclass(slots=True)
class Outcome:
    """How the request ended: the HTTP status recorded and the timeline's end state."""

    status: int
    end_state: str  # finished's reasons (e.g. "length"), or rejected, cancelled, timeout, error


class GenerationRequest:
    """A generation request in flight and everything it holds (see the module doc)."""

    def __init__(self, pipeline: Pipeline, kind: EndpointKind, body: GenerationBody,
                 headers: Mapping[str, str], request_id: str | None = None):
        self.pipeline, self.kind, self.body = pipeline, kind, body
        self.request_id = request_id or f"{kind.id_prefix}-{uuid.uuid4().hex}"
        request_id_var.set(self.request_id)
        self.deadline = asyncio.get_running_loop().time() + pipeline.settings.request_timeout_s
        self.response_headers = {"X-Request-Id": self.request_id}
        self.check: Callable[[], None] = _alive
        """Raises ClientDisconnected / RequestTimedOut once either ended the request."""
        self.model: ServedModel | None = None
        self.tenant: Tenant | None = None
        self.prompts: list[PromptTokens] = []
        self.usage: UsageTotals | None = None
        self.outcome: Outcome | None = None
        self.kept_response: dict | None = None  # the whole response, if its kind keeps it
        self._headers = headers
        self._record = pipeline.metrics.start(kind.name)
        self._timeline = TimelineDraft(pipeline.timelines, self.request_id)
        self._admission: TenantAdmission | None = None
        self._choices = ChoiceStreams()
        self._bindings = PendingBindings()
        self._num_moves = 0
        self._plan = OutputPlan()
        self._stack = AsyncExitStack()

    @property
    def cache_salt(self) -> str:
        return self.tenant.cache_salt_with(self.body.cache_salt)

    async def __aenter__(self) -> GenerationRequest:
        self._stack.callback(self._finish_record)
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        if self.outcome is None:
            self.end(exc)
        await run_to_completion(self._stack.aclose())

    def error_of(self, error: BaseException) -> APIError:
        """The client-facing form of a failure of this request."""
        return to_api_error(error, self.kind.prompt_param, self.pipeline.settings.retry_after_s)

    def end(self, error: APIError | BaseException | None) -> None:
        """Record how the request ended (None: its response was sent whole)."""
        if error is None:
            reason = self.usage.finish_reason if self.usage else None
            self.outcome = Outcome(200, reason or "unknown")
        elif isinstance(error, ClientDisconnected | asyncio.CancelledError):
            self.outcome = Outcome(DISCONNECTED_STATUS, "cancelled")
        elif isinstance(error, RequestTimedOut):
            self.outcome = Outcome(504, "timeout")
        else:
            api_error = error if isinstance(error, APIError) else self.error_of(error)
            admitted = self._timeline.reached(Stage.ADMITTED)
            self.outcome = Outcome(api_error.status, "error" if admitted else "rejected")

    # -- stage 1: admit -----------------------------------------------------------------

    async def admit(self) -> None:
        """Caller, model, limits, prompts, priority, and the quota reservation."""
        pipeline, body = self.pipeline, self.body
        if pipeline.draining:
            raise unavailable("the gateway is shutting down", pipeline.settings.retry_after_s)
        self.tenant = await self._step(pipeline.admitter.authenticate(self._headers))
        self._stack.push_async_callback(self._write_the_end)
        self.model = await self._step(pipeline.catalog.resolve(body.model,
                                                               self.tenant.tenant_id))
        check_limits(body, self.model, pipeline.settings.max_n)
        self._plan = output_plan(body, ToolCallFormat(pipeline.settings.tool_call_parser))
        tier = self.tenant.tier
        self._priority = engine_priority(tier, tier.max_priority_offset if body.is_flex
                                         else body.priority)
        self._timeline.record(**body.timeline_fields)
        self.prompts = await self._step(self.kind.prepare_prompts(self))
        self._max_tokens = [max_tokens_for(body.requested_max_tokens, p, self.kind.prompt_param)
                            for p in self.prompts]
        num_prompt_tokens = sum(p.num_tokens for p in self.prompts)
        self._admission = pipeline.admitter.admission(self.tenant, num_prompt_tokens,
                                                      sum(self._max_tokens) * body.n)
        admitted_at = time.time()
        await self._step(self._reserve(self._timeline.pending(
            self.tenant.tenant_id, admitted=admitted_at, num_prompt_tokens=num_prompt_tokens)))
        self.response_headers.update(self._admission.rate_limit_headers)
        self._timeline.mark(Stage.ADMITTED, at=admitted_at, num_prompt_tokens=num_prompt_tokens)
        if not self._admission.carries_timeline:
            await self._step(self._save_timeline())

    # -- stage 2: route and start -------------------------------------------------------

    async def start(self) -> tuple[int, GenerationDelta]:
        """Route, open every choice, and return the first delta, so that a failure before
        any output is an HTTP error, not a broken stream. An engine that cannot be reached
        (left out for a while) or whose waiting queue is full is replaced by another one,
        up to max_engine_attempts engines; then the last refusal is the answer (503)."""
        tried: list[str] = []
        while True:
            engine = await self._pick(tried)
            try:
                return await self._open_choices(engine)
            except UpstreamError as error:
                if not _another_engine_may_serve(error) or \
                        len(tried) + 1 >= self.pipeline.settings.max_engine_attempts:
                    raise
                log.warning("engine %s (%s) refused the request, trying another: %s",
                            engine.engine_id, engine.address, error.message)
                if error.code == "UNAVAILABLE":
                    self.pipeline.directory.mark_unreachable(engine.engine_id)
                tried.append(engine.engine_id)
                last_error = error
            await self._choices.close()
            self._choices = ChoiceStreams()
            if not await self._has_other_engine(tried):
                raise last_error

    async def _pick(self, tried: list[str]) -> EngineEntry:
        engine = await self._step(self.pipeline.router.pick(
            self.session_key, self.prompts[0].token_ids, cache_salt=self.cache_salt,
            model=self.model.backend_name, lora=self.model.lora_name, exclude=tried,
            pending=self._bindings))
        self.response_headers[ENGINE_HEADER] = engine.engine_id
        return engine

    async def _has_other_engine(self, tried: list[str]) -> bool:
        live = await self._step(self.pipeline.router.live_engines(self.model.backend_name,
                                                                  self.model.lora_name))
        return any(e.engine_id not in tried for e in live)

    async def _open_choices(self, engine: EngineEntry) -> tuple[int, GenerationDelta]:
        """One choice per (prompt, sample); choice index = prompt index * n + sample.
        The n samples of a prompt are one Generate call (the engine computes the prompt
        once), its stream split by sample (generation.py:ChoiceStreams.open)."""
        pipeline, body = self.pipeline, self.body
        target = (engine.engine_id, engine.address)
        self._stack.push_async_callback(self._choices.close)
        budgets = zip(self.prompts, self._max_tokens, strict=True)
        for prompt_index, (prompt, max_tokens) in enumerate(budgets):
            job_id = f"{self.request_id}-{'p' if body.n > 1 else ''}{prompt_index}"
            job = GenerateJob(job_id, prompt.token_ids,
                              sampling_options(body, max_tokens, prompt.bad_words),
                              self._priority, self.cache_salt, n=body.n,
                              constraint=self._plan.constraint, lora=self.model.lora)
            choice_ids = [f"{self.request_id}-{prompt_index * body.n + sample}"
                          for sample in range(body.n)]
            await self._choices.open(pipeline.detok, target, job, choice_ids,
                                     self._detok_options, self._move_choice)
        self._timeline.mark(Stage.QUEUED, engine_id=engine.engine_id)
        describe_generation(self.kind.name, self.model.name, body.requested_max_tokens,
                            self.request_id)
        self.usage = UsageTotals([p.num_tokens for p in self.prompts], body.n)
        first = await self.next_delta()
        if first is None:
            raise UpstreamError("engine", "INTERNAL", "the generation ended without output")
        self._record.first_token()
        self._timeline.mark(Stage.FIRST_TOKEN)
        return first

    def _detok_options(self, request_id: str) -> DetokOptions:
        return detok_options(self.body, request_id, self._plan.tool_calls)

    async def _move_choice(self, failed_engine_id: str, failure: Exception) -> Target | None:
        """Another live engine for a choice whose engine failed mid-stream, while the
        request has moves left (max_stream_moves); None otherwise (the failure stands)."""
        settings = self.pipeline.settings
        if self._num_moves >= settings.max_stream_moves:
            return None
        if getattr(failure, "code", None) == "UNAVAILABLE":
            self.pipeline.directory.mark_unreachable(failed_engine_id)
        try:
            engine = await self.pipeline.router.pick(
                self.session_key, self.prompts[0].token_ids, cache_salt=self.cache_salt,
                model=self.model.backend_name, lora=self.model.lora_name,
                exclude=[failed_engine_id], pending=self._bindings)
        except (NoEngineAvailable, AdaptersNotServed, RedisError) as error:
            log.warning("engine %s failed mid-stream and no other can take over: %s",
                        failed_engine_id, error)
            return None
        self._num_moves += 1
        log.warning("engine %s failed mid-stream (%s); the generation moves to %s",
                    failed_engine_id, failure, engine.engine_id)
        self._timeline.record(num_moves=self._num_moves, engine_id=engine.engine_id)
        self.response_headers[ENGINE_HEADER] = engine.engine_id  # if not sent yet
        return engine.engine_id, engine.address

    # -- stage 3: generate --------------------------------------------------------------

    async def next_delta(self) -> tuple[int, GenerationDelta] | None:
        """(choice index, delta) of the next output, None once every choice finished."""
        self.check()
        item = await self._choices.next_delta()
        self.check()
        if item is not None:
            self.usage.observe(*item)
        return item

    @property
    def session_key(self) -> str | None:
        return self._headers.get(SESSION_HEADER) or self.body.routing_key

    def response_format(self) -> ResponseFormat:
        return self.kind.format(self)

    # -- releases (registered on the exit stack) ----------------------------------------

    async def _step(self, awaitable: Awaitable[T]) -> T:
        """Await one stage's call, then check the request is still wanted (a library
        may have swallowed the cancellation that should have ended it)."""
        result = await awaitable
        self.check()
        return result

    async def _reserve(self, timeline: TimelineWrite) -> None:
        """Reserve the quota, writing `timeline` with it; while Redis is unavailable,
        refuse (503) unless the quota_fail_open setting serves the request unmetered
        (its timeline unwritten)."""
        try:
            await self._admission.reserve(timeline)
        except RedisError as error:
            if not self.pipeline.settings.quota_fail_open:
                raise
            log.warning("Redis unavailable, serving without a quota check: %s", error)

    async def _write_the_end(self) -> None:
        """One round trip: settle (return what the request did not use; all of it when
        it produced nothing), the timeline with its end state, the routing bindings."""
        counts = {} if self.usage is None else {
            "num_completion_tokens": self.usage.num_tokens_spent,
            "num_cached_tokens": self.usage.cached_tokens,
            "num_draft_tokens": self.usage.draft_tokens,
            "num_accepted_draft_tokens": self.usage.accepted_draft_tokens}
        self._timeline.mark(Stage.FINISHED, finish_reason=self.outcome.end_state, **counts)
        timeline = self._timeline.pending(self.tenant.tenant_id)
        usage = self.usage if self.usage and self.usage.num_tokens_seen else None
        settle = self._admission and self._admission.settle_call(
            usage and _Spent(usage.num_tokens_spent), timeline)
        calls = [settle or self.pipeline.timelines.write_call(timeline), *self._bindings.calls]
        if self.outcome.status == 200:
            calls += self.kind.end_calls(self)
        try:
            await run_script_calls(self.pipeline.redis, calls)
        except RedisError as error:  # an unsettled reservation frees itself at its lease
            log.warning("could not settle or write the timeline of %s: %s",
                        self.request_id, error)

    async def _save_timeline(self) -> None:
        """Save the timeline so far, where the admission did not carry it (a batch line)."""
        try:
            await self._timeline.save(self.tenant.tenant_id)
        except RedisError as error:  # a timeline is for looking at, never a reason to fail
            log.warning("could not write the timeline of %s: %s", self.request_id, error)

    def _finish_record(self) -> None:
        if self.usage is not None:
            self._record.tokens(self.usage)
            record_usage(self.usage, self.outcome.end_state,
                         self.response_headers.get(ENGINE_HEADER))
        self._record.finish(self.outcome.status)
        if self.outcome.status == DISCONNECTED_STATUS:
            log.info("client went away; request cancelled")


@dataclass(slots=True, frozen=True)
class _Spent:
    """What a request is charged for its output (TenantAdmission.settle's argument)."""

    completion_tokens: int


def _another_engine_may_serve(error: UpstreamError) -> bool:
    """The engine could not be reached, or shed the request (waiting queue full)."""
    return error.service == "engine" and (
        error.code == "UNAVAILABLE" or error.reason == QUEUE_FULL)


def _alive() -> None:
    """The check of a request nobody watches (it never ends early)."""


async def run_to_completion(cleanup: Coroutine[Any, Any, T]) -> T:
    """Run `cleanup` to its end in a task of its own: a cancellation of the caller
    meanwhile waits for the cleanup to finish and is raised afterwards."""
    task = asyncio.ensure_future(cleanup)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.done():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError()
    return result
