"""Background responses: POST /v1/responses with `background` true.

The gateway answers at once with the response `queued` (stored with its run: store.py)
and generates it in a task of this replica, on the same path as any request: the
request's GenerationResponse, served to no client (its bytes are read here). The task is
the run's one owner:
    - it marks the run in_progress, then renews the run's lease every `lease_s / 10`,
      reading its status each time;
    - a cancel (POST /v1/responses/{id}/cancel, on any replica) or a DELETE ends the
      generation as a client's disconnect would: the engine aborts, the quota is settled;
    - the complete response replaces the record (only over an in_progress run); an error
      response fails the run with its error.
On shutdown the tasks still running are cancelled and their runs failed. A replica that
dies leaves a lease that runs out: the response then reads failed.

Streamed (`stream` and `background`), the response's events are recorded in Redis as the
task's generation writes them, after a first `response.queued`; the POST, and any later
GET with `stream=true` (from `starting_after`, on any replica), tail that record until its
final event or until the run ends without one (cancelled, or failed before its stream).
A reader that goes away stops reading; the generation goes on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping

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
from conveyor.gateway.responses.store import ResponseStore, StoredResponse
from conveyor.gateway.routes import GenerationResponse

log = logging.getLogger("conveyor.gateway.responses")

STOPPED = {"code": "server_error",
           "message": "the gateway replica generating this response shut down"}
_LIVE = ("queued", "in_progress")
_FINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")


class BackgroundResponses:
    """This replica's background responses in flight (see the module doc)."""

    def __init__(self, store: ResponseStore, lease_s: float, poll_s: float):
        self._store = store
        self._lease_s = lease_s
        self._block_ms = max(1, round(poll_s * 1000))
        self._ended: dict[str, asyncio.Event] = {}
        self._tasks: set[asyncio.Task] = set()

    @property
    def running(self) -> int:
        return len(self._tasks)

    async def start(self, pipeline: Pipeline, headers: Mapping[str, str],
                    chat: ResponsesChat) -> tuple[str, dict]:
        """Check the caller, model and conversation, store the response queued, and
        start generating it; the tenant's id and the queued response."""
        if pipeline.draining:
            raise unavailable("the gateway is shutting down", pipeline.settings.retry_after_s)
        tenant = await pipeline.admitter.authenticate(headers)
        model = await pipeline.catalog.resolve(chat.model, tenant.tenant_id)
        turn = chat.turn
        await turn.continue_from(self._store, tenant.tenant_id)
        turn.created_at = int(time.time())
        response_id = f"{RESPONSES.id_prefix}-{uuid.uuid4().hex}"
        response = ResponsesFormat(response_id, model.name, num_top_logprobs(chat),
                                   output_options(chat), [], turn).queued()
        await self._store.create_background(
            tenant.tenant_id, StoredResponse(response, turn.conversation_with(None)),
            self._lease_s)
        if chat.stream:
            await self._store.append_event(tenant.tenant_id, response_id, 0, encode_event(
                {"type": "response.queued", "response": response}, 0), final=False)
            turn.first_sequence_number = 1
        self._ended[response_id] = ended = asyncio.Event()
        task = asyncio.create_task(self._run(pipeline, dict(headers), chat, tenant.tenant_id,
                                             response_id, ended))
        self._tasks.add(task)
        task.add_done_callback(lambda done: self._forget(done, response_id))
        return tenant.tenant_id, response

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
            if not events and not await self._live(tenant_id, response_id):
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
            if response_id in self._ended:  # generated here: end it now, not at the renewal
                self._ended[response_id].set()
            stored = await self._store.get(tenant_id, response_id)
        return stored.response

    async def close(self) -> None:
        """Cancel the runs still going (each fails its run) and wait for them."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _run(self, pipeline: Pipeline, headers: dict[str, str], chat: ResponsesChat,
                   tenant_id: str, response_id: str, ended: asyncio.Event) -> None:
        try:
            if await self._renew(tenant_id, response_id) != "in_progress":
                return
            renewals = asyncio.create_task(self._keep_renewing(tenant_id, response_id, ended))
            reply = _Reply(self._store, tenant_id, response_id,
                           chat.turn.first_sequence_number if chat.stream else None)
            try:
                await GenerationResponse(pipeline, headers, chat, RESPONSES, response_id)(
                    {"type": "http"}, _until(ended), reply)
            finally:
                renewals.cancel()
            if not ended.is_set():  # a run still live now did not complete: it failed
                await self._store.advance(tenant_id, response_id, "failed",
                                          error=reply.error())
                await reply.end_stream()
        except asyncio.CancelledError:
            await run_to_completion(self._fail_quietly(tenant_id, response_id, STOPPED))
            raise
        except Exception as error:  # noqa: BLE001 - a fault fails the run, never the replica
            log.exception("background response %s: %s", response_id, error)
            await self._fail_quietly(tenant_id, response_id, response_error(
                APIError(500, f"the gateway failed to generate this response: {error}")))

    async def _keep_renewing(self, tenant_id: str, response_id: str,
                             ended: asyncio.Event) -> None:
        """Renew the run's lease until it is no longer in progress (cancelled, deleted,
        lease lost), then end the generation."""
        while True:
            await asyncio.sleep(self._lease_s / 10)
            try:
                status = await self._renew(tenant_id, response_id)
            except RedisError as error:  # tried again at the next renewal
                log.warning("background response %s: lease not renewed: %s", response_id,
                            error)
                continue
            if status != "in_progress":
                ended.set()
                return

    async def _live(self, tenant_id: str, response_id: str) -> bool:
        try:
            stored = await self._store.get(tenant_id, response_id)
        except APIError:  # deleted
            return False
        return stored.response["status"] in _LIVE

    async def _renew(self, tenant_id: str, response_id: str) -> str | None:
        return await self._store.advance(tenant_id, response_id, "in_progress", self._lease_s)

    async def _fail_quietly(self, tenant_id: str, response_id: str, error: dict) -> None:
        try:
            await self._store.advance(tenant_id, response_id, "failed", error=error)
        except RedisError as redis_error:  # its lease runs out instead
            log.warning("background response %s: not marked failed: %s", response_id,
                        redis_error)

    def _forget(self, task: asyncio.Task, response_id: str) -> None:
        self._tasks.discard(task)
        self._ended.pop(response_id, None)


def _until(ended: asyncio.Event):
    """An ASGI receive whose client disconnects when `ended` is set."""
    async def receive() -> dict:
        await ended.wait()
        return {"type": "http.disconnect"}

    return receive


class _Reply:
    """An ASGI send that keeps the response's status and error, and records a streamed
    response's events (`first`: the number of its first; None: not streamed)."""

    def __init__(self, store: ResponseStore, tenant_id: str, response_id: str,
                 first: int | None):
        self._store, self._tenant_id, self._response_id = store, tenant_id, response_id
        self._next = first
        self.status = 0
        self._body = bytearray()
        self._final_seen = False
        self._failure: dict | None = None

    async def __call__(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        elif self._next is None or self.status != 200:
            self._body += message.get("body", b"")
        else:
            for event in message.get("body", b"").split(b"\n\n"):
                if event:
                    await self._record(event + b"\n\n")

    async def _record(self, event: bytes) -> None:
        kind = event.split(b"\n", 1)[0].removeprefix(b"event: ").decode()
        final = kind in _FINAL_EVENTS
        if kind == "response.failed":
            self._failure = json.loads(event.split(b"data: ", 1)[1])["response"]["error"]
        await self._store.append_event(self._tenant_id, self._response_id, self._next, event,
                                       final)
        self._next += 1
        self._final_seen |= final

    async def end_stream(self) -> None:
        """A streamed response that failed before its final event: record its
        response.failed, so that its readers see why it ended."""
        if self._next is None or self._final_seen:
            return
        stored = await self._store.get(self._tenant_id, self._response_id)
        await self._record(encode_event({"type": "response.failed",
                                         "response": stored.response}, self._next))

    def error(self) -> dict:
        """The failed Response's error: from the error body, or the stream's
        response.failed, or (neither) a generation that ended incomplete."""
        if self._failure is not None:
            return self._failure
        if self.status == 200:
            return {"code": "server_error", "message": "the generation ended unfinished"}
        try:
            message = json.loads(self._body)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = bytes(self._body[:300]).decode(errors="replace")
        return response_error(APIError(self.status, message))
