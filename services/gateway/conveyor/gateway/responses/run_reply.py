"""What a background response's generation sends, read by its run (background.py) instead
of a client: the status and error of its answer, and a streamed response's events, each
recorded in the store as it comes but the last: a completed stream's final event is
written with the stored response (ResponsesTurn.final_event), a failed one's with the
run's failure (`failed_event`), so a reader that sees it finds the response final.

Events are not written one round trip each on the generation's path: they queue, and one
flushing task at a time writes all that queued since its last write in one script call.
The queue is flushed before the final event is handed on, so the final event, whose id is
the highest, is written last."""

from __future__ import annotations

import asyncio
import json

from conveyor.gateway.errors import APIError
from conveyor.gateway.responses.conversation import ResponsesTurn
from conveyor.gateway.responses.output_format import encode_event, response_error
from conveyor.gateway.responses.store import Event, ResponseStore

_COMPLETE_EVENTS = ("response.completed", "response.incomplete")
_KEPT_HEADERS = ("retry-after", "x-ratelimit-")
"""Headers of a refusal that its creator's answer carries on (when to retry)."""


class RunReply:
    """An ASGI send that keeps the response's status, error and refusal headers, and
    records a streamed response's events (`turn` set: streamed, from its
    first_sequence_number; `response`: the response as created)."""

    def __init__(self, store: ResponseStore, tenant_id: str, response: dict,
                 turn: ResponsesTurn | None):
        self._store, self._tenant_id, self._response = store, tenant_id, response
        self._turn = turn
        self._next = turn.first_sequence_number if turn is not None else 0
        self.status = 0
        self._headers: dict[str, str] = {}
        self._body = bytearray()
        self._failed: Event | None = None
        self._failure: dict | None = None
        self._queued: list[Event] = []
        self._flushing: asyncio.Task | None = None

    def afresh(self) -> RunReply:
        """A reply for another try at the same response (this one's sent no event)."""
        return RunReply(self._store, self._tenant_id, self._response, self._turn)

    async def __call__(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self._headers = {k.decode("latin-1"): v.decode("latin-1")
                             for k, v in message.get("headers", ())}
        elif self._turn is None or self.status != 200:
            self._body += message.get("body", b"")
        else:
            for event in message.get("body", b"").split(b"\n\n"):
                if event:
                    await self._take(event + b"\n\n")

    async def _take(self, event: bytes) -> None:
        data = json.loads(event.split(b"data: ", 1)[1])
        sequence_number, kind = data["sequence_number"], data["type"]
        self._next = sequence_number + 1
        if kind in _COMPLETE_EVENTS:
            await self.flushed()
            self._turn.final_event = (sequence_number, event)
        elif kind == "response.failed":
            self._failed, self._failure = (sequence_number, event), data["response"]["error"]
        else:
            self._queued.append((sequence_number, event))
            if self._flushing is None or self._flushing.done():
                self._flushing = asyncio.create_task(self._flush())

    async def flushed(self) -> None:
        """Wait until every event queued so far is written (its failure raised here)."""
        if self._flushing is not None:
            await self._flushing
        await self._flush()

    async def _flush(self) -> None:
        while self._queued:
            events, self._queued = self._queued, []
            await self._store.append_events(self._tenant_id, self._response["id"], events)

    def failed_event(self, error: dict) -> Event | None:
        """The response.failed that ends a streamed run that failed: its stream's own, or
        (it failed before its stream) one made of the response as created; None when
        not streamed."""
        if self._turn is None or self._failed is not None:
            return self._failed
        failed = {**self._response, "status": "failed", "error": error}
        return self._next, encode_event({"type": "response.failed", "response": failed},
                                        self._next)

    def refusal(self) -> APIError:
        """The error answer, as the APIError it was sent from (its retry headers kept)."""
        try:
            error = json.loads(self._body)["error"]
        except (ValueError, KeyError, TypeError):
            error = {"message": bytes(self._body[:300]).decode(errors="replace"),
                     "type": "server_error"}
        headers = {k: v for k, v in self._headers.items() if k.startswith(_KEPT_HEADERS)}
        return APIError(self.status or 500, error.get("message", ""),
                        error.get("type", "server_error"), error.get("param"),
                        error.get("code"), headers)

    def error(self) -> dict:
        """The failed Response's error: the stream's response.failed, or the error answer,
        or (neither) a generation that ended unfinished."""
        if self._failure is not None:
            return self._failure
        if self.status == 200:
            return {"code": "server_error", "message": "the generation ended unfinished"}
        return response_error(self.refusal())
