"""What a background response's generation sends, read by its run (background.py) instead
of a client: the status and error of its answer, and a streamed response's events, each
recorded in the store as it comes."""

from __future__ import annotations

import json

from conveyor.gateway.errors import APIError
from conveyor.gateway.responses.output_format import encode_event, response_error
from conveyor.gateway.responses.store import ResponseStore

_FINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")
_KEPT_HEADERS = ("retry-after", "x-ratelimit-")
"""Headers of a refusal that its creator's answer carries on (when to retry)."""


class RunReply:
    """An ASGI send that keeps the response's status, error and refusal headers, and
    records a streamed response's events (`first`: the number of its first event; None:
    not streamed)."""

    def __init__(self, store: ResponseStore, tenant_id: str, response_id: str,
                 first: int | None):
        self._store, self._tenant_id, self._response_id = store, tenant_id, response_id
        self._next = first
        self.status = 0
        self._headers: dict[str, str] = {}
        self._body = bytearray()
        self._final_seen = False
        self._failure: dict | None = None

    async def __call__(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self._headers = {k.decode("latin-1"): v.decode("latin-1")
                             for k, v in message.get("headers", ())}
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
