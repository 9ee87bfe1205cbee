"""Background responses: POST /v1/responses with `background` true.

The gateway stores the response `queued` (with its run: store.py) and generates it in a
task of this replica, on the same path as any request: the request's GenerationResponse,
served to no client (its bytes are read by run_reply.py). The POST is answered once the
request is admitted (the response then in_progress); a request the path refuses before
that (a prompt too long, a rate limit, a revoked key) is answered with that error, as a
plain request would be, and leaves nothing stored. The task is the run's one owner:
    - it marks the run in_progress, then renews the run's lease every `lease_s / 10`,
      reading its status each time; a lease it could not renew for `lease_s` ends it;
    - a cancel (POST /v1/responses/{id}/cancel, on any replica) or a DELETE ends the
      generation as a client's disconnect would: the engine aborts, the quota is settled;
    - the complete response replaces the record (only over an in_progress run); an error
      response fails the run with its error, but for engines all full once the request
      was admitted (a 503 before any output): the task tries again after Retry-After,
      within the request timeout, as a client of a plain request would.
On shutdown the tasks still running are cancelled and their runs failed. A replica that
dies leaves a lease that runs out: the response then reads failed.

Streamed (`stream` and `background`), the response's events are recorded in Redis as the
task's generation writes them (run_reply.py), after a first `response.created` and
`response.queued` (the response queued); the final event is written with the stored
response or the run's failure. The POST, and any later GET with `stream=true` (from
`starting_after`, on any replica), tail that record until its final event, or until the
run ends without one (cancelled, deleted, its lease lost, its replica shut down). A reader
that goes away stops reading; the generation goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

from redis.exceptions import RedisError

from conveyor.gateway.api.mapping import num_top_logprobs, output_options
from conveyor.gateway.errors import APIError, bad_request, unavailable
from conveyor.gateway.generation_request import run_to_completion
from conveyor.gateway.pipeline import Pipeline
from conveyor.gateway.responses.conversation import ResponsesChat
from conveyor.gateway.responses.endpoint import RESPONSES
from conveyor.gateway.responses.output_format import (
    ResponsesFormat,
    encode_event,
    response_error,
)
from conveyor.gateway.responses.run_reply import RunReply
from conveyor.gateway.responses.store import ResponseStore, StoredResponse
from conveyor.gateway.routes import GenerationResponse

log = logging.getLogger("conveyor.gateway.responses")

STOPPED = {"code": "server_error",
           "message": "the gateway replica generating this response shut down"}
_LIVE = ("queued", "in_progress")
_ENGINES_FULL = ("engine_overloaded", "no_engine_available")
"""503s after admission that a background response waits out (it tries again) rather than
fails: a client of background mode has no request to retry."""
_MIN_RETRY_S = 0.1


@dataclass(slots=True)
class _Run:
    """One background response being generated here."""

    tenant_id: str
    response_id: str
    reply: RunReply
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    """Set to end the generation (cancelled, deleted, lease lost): its client's disconnect."""
    admitted: asyncio.Event = field(default_factory=asyncio.Event)


class BackgroundResponses:
    """This replica's background responses in flight (see the module doc)."""

    def __init__(self, store: ResponseStore, lease_s: float, poll_s: float):
        self._store = store
        self._lease_s = lease_s
        self._block_ms = max(1, round(poll_s * 1000))
        self._runs: dict[str, _Run] = {}
        self._tasks: set[asyncio.Task] = set()

    @property
    def running(self) -> int:
        return len(self._tasks)

    async def start(self, pipeline: Pipeline, headers: Mapping[str, str],
                    chat: ResponsesChat) -> tuple[str, dict]:
        """Check the caller, model and conversation, store the response queued, start
        generating it, and wait for its admission; the tenant's id and the response."""
        if pipeline.draining:
            raise unavailable("the gateway is shutting down", pipeline.settings.retry_after_s)
        tenant = await pipeline.admitter.authenticate(headers)
        model = await pipeline.catalog.resolve(chat.model, tenant.tenant_id)
        turn = chat.turn
        await turn.continue_from(self._store, pipeline.conversations, tenant.tenant_id)
        turn.created_at = int(time.time())
        response_id = f"{RESPONSES.id_prefix}-{uuid.uuid4().hex}"
        response = ResponsesFormat(response_id, model.name, num_top_logprobs(chat),
                                   output_options(chat), [], turn).queued()
        await self._store.create_background(
            tenant.tenant_id, StoredResponse(response, turn.conversation_with(None)),
            self._lease_s)
        if chat.stream:
            await self._store.append_events(tenant.tenant_id, response_id, [
                (number, encode_event({"type": kind, "response": response}, number))
                for number, kind in enumerate(("response.created", "response.queued"))])
            turn.first_sequence_number = 2
        run = _Run(tenant.tenant_id, response_id, RunReply(
            self._store, tenant.tenant_id, response, turn if chat.stream else None))
        task = self._launch(run, self._generate(pipeline, dict(headers), chat, run))
        await self._admitted(run, task, pipeline.settings.retry_after_s)
        return tenant.tenant_id, {**response, "status": "in_progress"}

    async def events(self, tenant_id: str, response_id: str,
                     after: int) -> AsyncIterator[bytes]:
        """The recorded events of a streamed background response after `after`, as they
        come, until its final one, or until its run ended without one."""
        store = self._store
        while True:
            events = await store.read_events(tenant_id, response_id, after, self._block_ms)
            for sequence_number, event, final in events:
                yield event
                if final:
                    return
                after = sequence_number
            if not events and not await store.is_live(tenant_id, response_id):
                for _, event, _ in await store.read_events(tenant_id, response_id, after, None):
                    yield event  # written between the read and the status
                return

    async def check_streamed(self, tenant_id: str, response_id: str) -> None:
        """Check that the tenant's response can be streamed again (a 400 naming `stream`
        if it was not streamed, a 404 if there is none)."""
        await self._store.get(tenant_id, response_id)
        if not await self._store.has_events(tenant_id, response_id):
            raise bad_request("Only a response created with background and stream can be "
                              "streamed again.", "stream")

    async def cancel(self, tenant_id: str, response_id: str) -> dict:
        """Cancel the tenant's background response if it is still queued or in progress;
        the response as it stands (cancelling twice, or a finished one, changes nothing)."""
        stored = await self._store.get(tenant_id, response_id)
        if not stored.response.get("background"):
            raise bad_request("Only responses created with background=true can be cancelled.")
        if stored.response["status"] in _LIVE:
            await self._store.advance(tenant_id, response_id, "cancelled")
            self.end_here(tenant_id, response_id)
            stored = await self._store.get(tenant_id, response_id)
        return stored.response

    def end_here(self, tenant_id: str, response_id: str) -> None:
        """End the generation now if this replica runs it (cancelled or deleted: the
        other replicas' runs find out at their next renewal)."""
        run = self._runs.get(response_id)
        if run is not None and run.tenant_id == tenant_id:
            run.ended.set()

    async def close(self) -> None:
        """Cancel the runs still going (each fails its run) and wait for them."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _launch(self, run: _Run, generation) -> asyncio.Task:
        self._runs[run.response_id] = run
        task = asyncio.create_task(self._owned(run, generation))
        self._tasks.add(task)
        task.add_done_callback(lambda done: self._forget(done, run.response_id))
        return task

    async def _admitted(self, run: _Run, task: asyncio.Task, retry_after_s: int) -> None:
        """Wait until the run's request is admitted; if it ended first, its refusal is the
        creator's answer and nothing of it stays stored (nor when the creator's own task
        is cancelled meanwhile: no client knows the response's id then)."""
        admitted = asyncio.ensure_future(run.admitted.wait())
        try:
            await asyncio.wait((admitted, task), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            run.ended.set()
            await run_to_completion(self._forget_stored(run))
            raise
        finally:
            admitted.cancel()
        if not run.admitted.is_set():
            await self._forget_stored(run)
            if run.reply.status == 0:  # it never answered: the run could not start
                raise unavailable("the background response could not start; try again",
                                  retry_after_s)
            raise run.reply.refusal()

    async def _forget_stored(self, run: _Run) -> None:
        with contextlib.suppress(APIError):  # already gone
            await self._store.delete(run.tenant_id, run.response_id)

    async def _owned(self, run: _Run, generation) -> None:
        """Run `generation` as the run's owner: a fault or a shutdown fails the run."""
        try:
            await generation
        except asyncio.CancelledError:
            await run_to_completion(self._fail_quietly(run, STOPPED))
            raise
        except Exception as error:  # noqa: BLE001 - a fault fails the run, never the replica
            log.exception("background response %s: %s", run.response_id, error)
            await self._fail_quietly(run, response_error(
                APIError(500, f"the gateway failed to generate this response: {error}")))

    async def _generate(self, pipeline: Pipeline, headers: dict[str, str],
                        chat: ResponsesChat, run: _Run) -> None:
        if await self._renew(run) != "in_progress":
            return
        renewals = asyncio.create_task(self._keep_renewing(run))
        give_up = asyncio.get_running_loop().time() + pipeline.settings.request_timeout_s
        try:
            while await self._tried_in_vain(pipeline, headers, chat, run, give_up):
                run.reply = run.reply.afresh()
        finally:
            renewals.cancel()
        await run.reply.flushed()
        if not run.ended.is_set():  # a run still live now did not complete: it failed
            error = run.reply.error()
            await self._store.advance(run.tenant_id, run.response_id, "failed", error=error,
                                      final_event=run.reply.failed_event(error))

    async def _tried_in_vain(self, pipeline: Pipeline, headers: dict[str, str],
                             chat: ResponsesChat, run: _Run, give_up: float) -> bool:
        """Generate the response once; whether to try again: the request was admitted, then
        every engine was full (a 503 before any output), and the run is still live once
        Retry-After has passed, before `give_up` (the request timeout from the start)."""
        await GenerationResponse(pipeline, headers, chat, RESPONSES, run.response_id,
                                 run.admitted)({"type": "http"}, _until(run.ended), run.reply)
        reply, loop = run.reply, asyncio.get_running_loop()
        wait_s = max(pipeline.settings.retry_after_s, _MIN_RETRY_S)
        if (reply.status != 503 or reply.refusal().code not in _ENGINES_FULL
                or not run.admitted.is_set() or loop.time() + wait_s > give_up):
            return False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(run.ended.wait(), wait_s)
        return not run.ended.is_set()

    async def _keep_renewing(self, run: _Run) -> None:
        """Renew the run's lease until it is no longer in progress (cancelled, deleted,
        lease lost) or could not be renewed for `lease_s`, then end the generation."""
        loop = asyncio.get_running_loop()
        renewed = loop.time()
        while True:
            await asyncio.sleep(self._lease_s / 10)
            try:
                status = await self._renew(run)
            except RedisError as error:  # tried again at the next renewal, while leased
                log.warning("background response %s: lease not renewed: %s", run.response_id,
                            error)
                if loop.time() - renewed < self._lease_s:
                    continue
                status = None
            renewed = loop.time()
            if status != "in_progress":
                run.ended.set()
                return

    async def _renew(self, run: _Run) -> str | None:
        return await self._store.advance(run.tenant_id, run.response_id, "in_progress",
                                         self._lease_s)

    async def _fail_quietly(self, run: _Run, error: dict) -> None:
        try:
            await self._store.advance(run.tenant_id, run.response_id, "failed", error=error)
        except RedisError as redis_error:  # its lease runs out instead
            log.warning("background response %s: not marked failed: %s", run.response_id,
                        redis_error)

    def _forget(self, task: asyncio.Task, response_id: str) -> None:
        self._tasks.discard(task)
        self._runs.pop(response_id, None)


def _until(ended: asyncio.Event):
    """An ASGI receive whose client disconnects when `ended` is set."""
    async def receive() -> dict:
        await ended.wait()
        return {"type": "http.disconnect"}

    return receive
