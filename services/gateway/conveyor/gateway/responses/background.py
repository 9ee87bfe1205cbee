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
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Mapping

from redis.exceptions import RedisError

from conveyor.gateway.api.mapping import num_top_logprobs, output_options
from conveyor.gateway.errors import APIError, bad_request, unavailable
from conveyor.gateway.generation_request import run_to_completion
from conveyor.gateway.pipeline import Pipeline
from conveyor.gateway.responses.conversation import ResponsesChat
from conveyor.gateway.responses.endpoint import RESPONSES
from conveyor.gateway.responses.output_format import ResponsesFormat, response_error
from conveyor.gateway.responses.store import ResponseStore, StoredResponse
from conveyor.gateway.routes import GenerationResponse

log = logging.getLogger("conveyor.gateway.responses")

STOPPED = {"code": "server_error",
           "message": "the gateway replica generating this response shut down"}
_LIVE = ("queued", "in_progress")


class BackgroundResponses:
    """This replica's background responses in flight (see the module doc)."""

    def __init__(self, store: ResponseStore, lease_s: float):
        self._store = store
        self._lease_s = lease_s
        self._ended: dict[str, asyncio.Event] = {}
        self._tasks: set[asyncio.Task] = set()

    @property
    def running(self) -> int:
        return len(self._tasks)

    async def start(self, pipeline: Pipeline, headers: Mapping[str, str],
                    chat: ResponsesChat) -> dict:
        """Check the caller, model and conversation, store the response queued, and
        start generating it; the queued response."""
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
        self._ended[response_id] = ended = asyncio.Event()
        task = asyncio.create_task(self._run(pipeline, dict(headers), chat, tenant.tenant_id,
                                             response_id, ended))
        self._tasks.add(task)
        task.add_done_callback(lambda done: self._forget(done, response_id))
        return response

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
            try:
                reply = _Reply()
                await GenerationResponse(pipeline, headers, chat, RESPONSES, response_id)(
                    {"type": "http"}, _until(ended), reply)
            finally:
                renewals.cancel()
            if reply.status != 200 and not ended.is_set():
                await self._store.advance(tenant_id, response_id, "failed",
                                          error=reply.error())
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
    """An ASGI send that keeps the response's status and body."""

    def __init__(self) -> None:
        self.status = 0
        self._body = bytearray()

    async def __call__(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        else:
            self._body += message.get("body", b"")

    def error(self) -> dict:
        """The failed Response's error, from the error body sent."""
        try:
            message = json.loads(self._body)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = bytes(self._body[:300]).decode(errors="replace")
        return response_error(APIError(self.status, message))
