"""Server-sent events: `data: {json}` per payload, `data: [DONE]` at the end.

The body is sent while racing the client's disconnect and the request's
deadline (cancellation.race_client). A failure after the stream started is sent
as `data: {"error": ...}` followed by `data: [DONE]`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from conveyor.gateway.cancellation import ClientDisconnected, RequestTimedOut, race_client
from conveyor.gateway.errors import APIError
from conveyor.gateway.metrics import DISCONNECTED_STATUS

log = logging.getLogger("conveyor.gateway.sse")

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def encode_event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class EventStreamResponse(Response):
    """Streams `payloads` as SSE. `on_close(status)` runs once when the stream is over
    (status 200, the error's status, or 499 when the client went away)."""

    media_type = "text/event-stream"

    def __init__(self, payloads: AsyncIterator[dict], deadline: float,
                 error_of: Callable[[BaseException], APIError],
                 on_close: Callable[[int], Awaitable[None]], headers: dict[str, str]):
        self.status_code = 200
        self.background = None
        self.init_headers({**SSE_HEADERS, **headers})  # no body, so no Content-Length
        self._payloads = payloads
        self._deadline = deadline
        self._error_of = error_of
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        status = DISCONNECTED_STATUS
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            status = await race_client(self._send_events(send), receive, self._deadline)
        except ClientDisconnected:
            status = DISCONNECTED_STATUS
        except RequestTimedOut as timeout:
            status = await self._send_error(send, self._error_of(timeout))
        finally:
            await self._payloads.aclose()
            await self._on_close(status)

    async def _send_events(self, send: Send) -> int:
        try:
            async for payload in self._payloads:
                await send({"type": "http.response.body", "body": encode_event(payload),
                            "more_body": True})
        except Exception as error:  # noqa: BLE001 - the client gets it as an error event
            return await self._send_error(send, self._error_of(error))
        await send({"type": "http.response.body", "body": DONE, "more_body": False})
        return 200

    async def _send_error(self, send: Send, error: APIError) -> int:
        log.info("stream ended by an error: %s %s", error.status, error.message)
        body = encode_event(error.body()) + DONE
        await send({"type": "http.response.body", "body": body, "more_body": False})
        return error.status
