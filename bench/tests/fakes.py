"""What the bench tests share: a fake OpenAI completions server (an httpx transport streaming
chunks at chosen delays) and builders of the suite's per-scenario figures."""

from __future__ import annotations

import asyncio
import json

import httpx


def sse(data: dict) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


def chunk(text: str, finish_reason: str | None = None) -> bytes:
    return sse({"object": "text_completion",
                "choices": [{"index": 0, "text": text, "finish_reason": finish_reason}]})


def usage_chunk(prompt_tokens: int, completion_tokens: int) -> bytes:
    return sse({"choices": [], "usage": {"prompt_tokens": prompt_tokens,
                                         "completion_tokens": completion_tokens}})


class FakeServer:
    """Answers each request with one chunk per token: the first after `first_delay_s`,
    the others `gap_s` apart; counts how many requests are in flight at once."""

    def __init__(self, first_delay_s: float = 0.05, gap_s: float = 0.01,
                 send_usage: bool = True, status: int = 200):
        self.first_delay_s, self.gap_s = first_delay_s, gap_s
        self.send_usage, self.status = send_usage, status
        self.in_flight = self.max_in_flight = 0
        self.requests: list[httpx.Request] = []

    @property
    def bodies(self) -> list[dict]:
        return [json.loads(r.content) for r in self.requests]

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if self.status != 200:
            return httpx.Response(self.status, json={"error": {"message": "nope"}})
        return httpx.Response(200, content=self.stream(json.loads(request.content)),
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


def figures(out_tps: float, ttft: float = 900.0, tpot: float = 70.0) -> dict:
    """One system's figures for one scenario, as the suite records them (16 requests in 10 s,
    the engine busy 1.5 cores)."""
    return {"completed": 16, "failed": 0, "output_throughput": out_tps, "request_throughput": 1,
            "p50_ttft_ms": ttft, "p99_ttft_ms": ttft, "mean_tpot_ms": tpot, "p50_tpot_ms": tpot,
            "p99_tpot_ms": tpot, "p50_e2el_ms": 5000.0, "duration_s": 10.0,
            "cpu_s": {"engine": 15.0, "client": 1.0},
            "cpu_s_per_request": {"engine": 1.5, "client": 0.1}}


def system(weights: str = "float32", **scenarios: dict) -> dict:
    """One system's results; scenario names are keywords with '_' for '-' (c16_prefix)."""
    return {"label": "x", "weights": weights, "skipped": [],
            "scenarios": {name.replace("_", "-"): f for name, f in scenarios.items()}}
