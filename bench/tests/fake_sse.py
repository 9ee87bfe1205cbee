"""A fake OpenAI completions server as an httpx transport: chunks at chosen delays."""

from __future__ import annotations

import asyncio
import json

import httpx


def chunk(text: str, finish_reason: str | None = None) -> bytes:
    data = {"object": "text_completion",
            "choices": [{"index": 0, "text": text, "finish_reason": finish_reason}]}
    return f"data: {json.dumps(data)}\n\n".encode()


def usage_chunk(prompt_tokens: int, completion_tokens: int) -> bytes:
    data = {"choices": [], "usage": {"prompt_tokens": prompt_tokens,
                                     "completion_tokens": completion_tokens}}
    return f"data: {json.dumps(data)}\n\n".encode()


class FakeServer:
    """Answers each request with one chunk per token: the first after `first_delay_s`,
    the others `gap_s` apart; counts how many requests are in flight at once."""

    def __init__(self, first_delay_s: float = 0.05, gap_s: float = 0.01,
                 send_usage: bool = True, status: int = 200):
        self.first_delay_s = first_delay_s
        self.gap_s = gap_s
        self.send_usage = send_usage
        self.status = status
        self.in_flight = 0
        self.max_in_flight = 0
        self.bodies: list[dict] = []

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append(body)
        if self.status != 200:
            return httpx.Response(self.status, json={"error": {"message": "nope"}})
        return httpx.Response(200, content=self.stream(body),
                              headers={"content-type": "text/event-stream"})

    async def stream(self, body: dict):
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            num = body["max_tokens"]
            await asyncio.sleep(self.first_delay_s)
            for i in range(num):
                if i:
                    await asyncio.sleep(self.gap_s)
                yield chunk(f" t{i}", "length" if i == num - 1 else None)
            if self.send_usage:
                yield usage_chunk(7, num)
            yield b"data: [DONE]\n\n"
        finally:
            self.in_flight -= 1
