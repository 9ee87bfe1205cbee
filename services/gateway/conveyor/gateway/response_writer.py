"""The bytes of one generation request's response: SSE events as its deltas come, or one
JSON body; errors before the first byte are JSON error bodies with their status, after it an
SSE error event and the stream's end. A request whose format keeps its response (chat's
`store`) gets the whole response built from a stream's deltas too."""

from __future__ import annotations

import asyncio
import json
import logging

from starlette.types import Send

from conveyor.gateway.clients.detok import GenerationDelta
from conveyor.gateway.errors import ClientDisconnected, RequestTimedOut
from conveyor.gateway.generation_request import GenerationRequest
from conveyor.gateway.logprob_entries import TokenIdTexts
from conveyor.gateway.response_formats import ChoiceResult, ResponseFormat

log = logging.getLogger("conveyor.gateway.sse")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ResponseWriter:
    """Writes one request's response: SSE events as deltas come, or one JSON body."""

    def __init__(self, send: Send, request: GenerationRequest, admitted: asyncio.Event):
        self._send = send
        self._admitted = admitted
        self.request = self._request = request
        self.started = False
        self._last: dict | None = None
        self._fmt: ResponseFormat | None = None

    async def serve(self) -> None:
        request = self._request
        await request.admit()
        self._admitted.set()
        first = await request.start()
        self._fmt = fmt = request.response_format()
        if request.body.stream:
            await self._stream(fmt, first)
        else:
            await self._collect(fmt, first)

    async def fail(self, error: BaseException) -> None:
        """End the response with `error` (nothing is written when the client is gone)."""
        request = self._request
        if isinstance(error, ClientDisconnected):
            request.end(error)
            return
        api_error = request.error_of(error)  # mapped (and an unexpected one logged) once
        request.end(error if isinstance(error, RequestTimedOut) else api_error)
        if self.started:
            log.info("stream ended by an error: %s %s", api_error.status, api_error.message)
            fmt = self._fmt
            await self._body(b"".join(fmt.encode(c) for c in fmt.error_chunks(api_error))
                             + fmt.stream_end, more=False)
        else:
            await self._json(api_error.status, api_error.body(), api_error.headers)

    async def _stream(self, fmt: ResponseFormat, first) -> None:
        request = self._request
        await self._start(200, {"content-type": "text/event-stream; charset=utf-8",
                                **SSE_HEADERS})
        for chunk in fmt.opening_chunks(request.body.n * len(request.usage.prompt_lengths)):
            await self._body(fmt.encode(chunk))
        kept = _Collected(request) if request.kind.keeps_response(request) else None
        item = first
        while item is not None:
            index, delta = item
            if kept is not None:
                kept.add(item)
            for chunk in fmt.delta_chunks(index, delta, self._texts(delta.token_texts)):
                await self._body(fmt.encode(chunk))
            item = await request.next_delta()
        if kept is not None:
            request.kept_response = fmt.response(kept.results, self._texts(kept.texts),
                                                 request.usage)
        for chunk in fmt.closing_chunks(request.usage):
            await self._body(fmt.encode(chunk))
        await self._body(fmt.stream_end, more=False)

    async def _collect(self, fmt: ResponseFormat, first) -> None:
        request = self._request
        collected = _Collected(request)
        item = first
        while item is not None:
            collected.add(item)
            item = await request.next_delta()
        payload = fmt.response(collected.results, self._texts(collected.texts), request.usage)
        if request.kind.keeps_response(request):
            request.kept_response = payload
        await self._json(200, payload)

    def _texts(self, texts: dict[int, str]) -> dict[int, str]:
        """The token texts logprobs show: detok's, or the token ids'."""
        return TokenIdTexts() if self._request.body.return_tokens_as_token_ids else texts

    async def _json(self, status: int, payload: dict, headers: dict[str, str] | None = None):
        body = json.dumps(payload, separators=(",", ":")).encode()
        await self._start(status, {**(headers or {}), "content-type": "application/json",
                                   "content-length": str(len(body))})
        await self._body(body, more=False)

    async def _start(self, status: int, headers: dict[str, str]) -> None:
        all_headers = {**self._request.response_headers, **headers}
        raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in all_headers.items()]
        await self._send({"type": "http.response.start", "status": status, "headers": raw})
        self.started = True

    async def _body(self, data: bytes, more: bool = True) -> None:
        """Send body bytes; the last ones wait for `send_last`."""
        message = {"type": "http.response.body", "body": data, "more_body": more}
        if more:
            await self._send(message)
        else:
            self._last = message

    async def send_last(self) -> None:
        """Send the response's last bytes (nothing when the client went away)."""
        if self._last is not None:
            await self._send(self._last)


class _Collected:
    """A request's choices as their deltas come, for its whole response."""

    def __init__(self, request: GenerationRequest):
        self.results = [ChoiceResult() for _ in range(request.body.n * len(
            request.usage.prompt_lengths))]
        self.texts: dict[int, str] = {}

    def add(self, item: tuple[int, GenerationDelta]) -> None:
        index, delta = item
        self.results[index].add(delta)
        self.texts.update(delta.token_texts)
