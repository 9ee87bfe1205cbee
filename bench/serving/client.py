"""One streamed /v1/completions request, timed the way `vllm bench serve` times it.

Every SSE chunk that carries `choices` is a token event: the first one sets TTFT,
each later one adds a gap to ITL, and the last one ends the latency. The output
token count comes from the final `usage` chunk (stream_options.include_usage);
a server that sends none is counted one token per chunk.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

from bench.serving.workload import BenchRequest


@dataclass(slots=True)
class RequestResult:
    """What one request measured; times in seconds, relative to its send time."""

    prompt_len: int
    success: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens_reported: int | None = None
    start_time: float = 0.0
    error: str = ""


def completion_body(request: BenchRequest, model: str, ignore_eos: bool = True) -> dict:
    """The JSON body: greedy unless the request samples, streamed, usage in the last chunk,
    exactly max_tokens out."""
    body = {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.max_tokens,
        "temperature": 0.0,
        **dict(request.sampling),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM's extension, also accepted by Conveyor's gateway
    return body


class ChunkTimer:
    """Turns the arrival times of SSE events into TTFT, ITL and latency."""

    def __init__(self, result: RequestResult, start: float):
        self.result = result
        self.start = start
        self.last = start
        self.num_chunks = 0

    def on_event(self, data: dict, now: float) -> None:
        if data.get("choices"):
            if self.num_chunks == 0:
                self.result.ttft = now - self.start
            else:
                self.result.itl.append(now - self.last)
            self.last = now
            self.num_chunks += 1
        usage = data.get("usage")
        if usage:
            self.result.output_tokens = int(usage.get("completion_tokens") or 0)
            self.result.prompt_tokens_reported = usage.get("prompt_tokens")

    def finish(self) -> RequestResult:
        if self.num_chunks == 0:
            self.result.error = self.result.error or "no tokens streamed"
            return self.result
        self.result.latency = self.last - self.start
        self.result.output_tokens = self.result.output_tokens or self.num_chunks
        self.result.success = True
        return self.result


def parse_sse_line(line: str) -> dict | None:
    """The JSON payload of one `data:` line; None for blank lines, comments and [DONE]."""
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if not payload or payload == "[DONE]":
        return None
    return json.loads(payload)


async def send_completion(client: httpx.AsyncClient, url: str, body: dict,
                          prompt_len: int, headers: dict | None = None) -> RequestResult:
    """POST `body` to `url` with streaming and time every chunk as it arrives."""
    result = RequestResult(prompt_len=prompt_len, start_time=time.perf_counter())
    timer = ChunkTimer(result, result.start_time)
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return result
            async for line in response.aiter_lines():
                data = parse_sse_line(line)
                if data is not None:
                    if "error" in data:
                        result.error = str(data["error"])[:300]
                        return result
                    timer.on_event(data, time.perf_counter())
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    return timer.finish()
