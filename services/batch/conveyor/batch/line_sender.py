"""Sending one batch line to the gateway, as a batch line of its batch's tenant.

The line goes to the gateway's own `/v1/chat/completions`, `/v1/completions` or
`/v1/responses` (non-streaming), so it runs through the same pipeline as interactive traffic:
tokenizer, routing, engine (at the tier's batch priority), detok. A 503 (no
capacity now) or a gateway out of reach is not the line's fault: the sender
waits (the Retry-After, growing up to max_backoff_s) and sends it again.
Cancelling the coroutine closes the HTTP request, which the gateway turns into
an engine abort.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets

import httpx

from conveyor.batch.input_lines import InputLine
from conveyor.common.batch_store import LineResult, LineUsage

log = logging.getLogger("conveyor.batch.lines")

BATCH_ID_HEADER = "X-Conveyor-Batch-Id"
"""Names the batch a line belongs to; with the internal token, the gateway bills the
batch's tenant at its tier's batch priority (conveyor.gateway.tenancy.batch_lines)."""
_RETRY_STATUSES = {502, 503, 504}


class LineSender:
    """Sends lines of one batch; `send` returns the line's result for the output files."""

    def __init__(self, client: httpx.AsyncClient, batch_id: str, token: str,
                 max_backoff_s: float):
        self._client = client
        self._headers = {"Authorization": f"Bearer {token}", BATCH_ID_HEADER: batch_id}
        self._max_backoff_s = max_backoff_s

    async def send(self, line: InputLine) -> tuple[LineResult, LineUsage]:
        attempt = 0
        while True:
            response = await self._post(line)
            if response is not None and response.status_code not in _RETRY_STATUSES:
                return _result(line, response), _usage(response)
            attempt += 1
            wait = self._backoff(response, attempt)
            log.info("line %s: gateway %s, retrying in %.1fs", line.custom_id,
                     response.status_code if response is not None else "unreachable", wait)
            await asyncio.sleep(wait)

    async def _post(self, line: InputLine) -> httpx.Response | None:
        try:
            return await self._client.post(line.url, json=line.body, headers=self._headers)
        except httpx.TransportError as error:
            log.warning("line %s: %s", line.custom_id, error)
            return None

    def _backoff(self, response: httpx.Response | None, attempt: int) -> float:
        retry_after = response.headers.get("retry-after") if response is not None else None
        try:
            wait = float(retry_after) if retry_after else 0.5 * 2 ** min(attempt, 8)
        except ValueError:
            wait = 1.0
        return min(self._max_backoff_s, wait) * random.uniform(1.0, 1.25)


def output_line(custom_id: str, response: dict | None, error: dict | None) -> dict:
    """One line of an output or error file, as OpenAI writes them."""
    return {"id": f"batch_req_{secrets.token_hex(12)}", "custom_id": custom_id,
            "response": response, "error": error}


def _result(line: InputLine, response: httpx.Response) -> LineResult:
    try:
        body = response.json()
    except ValueError:
        body = {"error": {"message": response.text, "type": "server_error", "param": None,
                          "code": None}}
    payload = {"status_code": response.status_code,
               "request_id": response.headers.get("x-request-id", ""), "body": body}
    return LineResult(response.is_success, output_line(line.custom_id, payload, None))


def _usage(response: httpx.Response) -> LineUsage:
    """The line's usage, in chat's and completions' names or the Responses API's."""
    try:
        usage = response.json().get("usage") or {}
    except (ValueError, AttributeError):
        return LineUsage()
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    return LineUsage(usage.get("prompt_tokens", usage.get("input_tokens", 0)),
                     usage.get("completion_tokens", usage.get("output_tokens", 0)),
                     details.get("cached_tokens") or 0)
