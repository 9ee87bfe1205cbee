"""Bodies over the gateway's limit are refused with 413 before they are read whole
(`BodySizeLimitMiddleware`)."""

from __future__ import annotations

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from conveyor.gateway.errors import APIError


class BodySizeLimitMiddleware:
    """Pure ASGI middleware: 413 for HTTP request bodies over `max_body_bytes`."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, exempt_paths: tuple[str, ...] = ()):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.exempt_paths = exempt_paths
        """Paths whose routes limit their bodies themselves (file uploads)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.exempt_paths:
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await self._refuse(scope, receive, send)
        elif declared is not None:  # the HTTP server stops a body at its Content-Length
            await self.app(scope, receive, send)
        else:
            await self._buffered(scope, receive, send)

    async def _buffered(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Read a chunked body up to the limit, then hand it on in one message."""
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                await self._refuse(scope, receive, send)
                return
            more = message.get("more_body", False)
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(413, f"the request body is larger than this gateway's limit of "
                         f"{self.max_body_bytes} bytes", param=None, code="request_too_large")
        await JSONResponse(error.body(), status_code=413,
                           headers={"Connection": "close"})(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length" and value.isdigit():
            return int(value)
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives `body` first, then whatever the client sends next
    (a disconnect, which the request path races against)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed
