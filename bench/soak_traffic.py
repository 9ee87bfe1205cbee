"""The soak's traffic: a seeded mix of request kinds from concurrent clients, every greedy
stream checked token by token against its prompt's reference (bench/soak.py runs it)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from bench.serving.client import parse_sse_line

MODEL = "smollm2-135m-instruct"
MAX_TOKENS = 24
PROMPTS = ["Name three colours.", "Describe a conveyor belt in one sentence.",
           "Count from one to ten.", "What is a tokenizer?"]
KINDS = {"stream": 4, "cancel": 2, "n2": 1, "stop": 2, "plain": 1, "bad": 1}
"""Traffic kinds and their weights."""
STREAM_ERROR = "stream_error"
"""Outcome of a stream that ended with an error event (the engine went away under it)."""
BAD_BODIES = [
    {"model": MODEL, "prompt": [2**32], "max_tokens": 2},
    {"model": MODEL, "messages": [{"role": "user", "content": "\ud800"}]},
    {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": "yes"},
    {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"²": 1}},
    {"model": MODEL, "prompt": "word " * 20_000, "max_tokens": 2},
]


def pick_kinds(seed: int, weights: dict[str, int] = KINDS):
    """An endless, reproducible stream of traffic kinds drawn by weight."""
    rng = random.Random(seed)
    names, counts = list(weights), list(weights.values())
    while True:
        yield rng.choices(names, counts)[0]


def stop_for(reference: str) -> str | None:
    """A stop string inside `reference` (its third word), or None if it is too short."""
    words = reference.split()
    return words[2] if len(words) > 3 else None


def expected_before_stop(reference: str, stop: str) -> str:
    """What a request with stop string `stop` must return: the text before its first match."""
    return reference[:reference.index(stop)]


@dataclass
class StreamRecord:
    """What one streamed choice carried."""

    text: str = ""
    num_logprobs: int = 0
    finish_reason: str | None = None


def token_problems(records: dict[int, StreamRecord], usage: dict | None, expected: str,
                   num_tokens: int) -> list[str]:
    """Why a greedy stream lost or duplicated tokens (empty when it did not)."""
    problems = []
    for index, record in records.items():
        if record.text != expected:
            problems.append(f"choice {index}: text differs from the reference")
        if record.num_logprobs != num_tokens:
            problems.append(f"choice {index}: {record.num_logprobs} tokens, not {num_tokens}")
    if usage is None or usage.get("completion_tokens") != num_tokens * len(records):
        problems.append(f"usage {usage} does not count {num_tokens} tokens per choice")
    return problems


@dataclass
class Tally:
    """What the traffic did, by kind and outcome, and every token problem seen."""

    outcomes: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)

    def count(self, kind: str, outcome: str) -> None:
        self.outcomes[(kind, outcome)] += 1


def chat_body(prompt: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **extra}


async def references(url: str) -> dict[str, str]:
    """Each prompt's greedy text (non-streamed), taken before the traffic."""
    out = {}
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        for prompt in PROMPTS:
            response = await client.post("/v1/chat/completions", json=chat_body(prompt))
            response.raise_for_status()
            out[prompt] = response.json()["choices"][0]["message"]["content"]
    return out


async def read_stream(client: httpx.AsyncClient, body: dict, max_chunks: int | None = None
                      ) -> tuple[int | str, dict[int, StreamRecord], dict | None]:
    """Status, each choice's record and the usage of a streamed chat; stops reading (and
    closes the stream, which cancels it) after `max_chunks` chunks when given."""
    records: dict[int, StreamRecord] = {}
    usage, num_chunks = None, 0
    body = {**body, "stream": True, "stream_options": {"include_usage": True}, "logprobs": True}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            return response.status_code, records, None
        async for line in response.aiter_lines():
            data = parse_sse_line(line)
            if data is None:
                continue
            if "error" in data:
                return STREAM_ERROR, records, None
            usage = data.get("usage") or usage
            for choice in data.get("choices", []):
                record = records.setdefault(choice["index"], StreamRecord())
                record.text += choice["delta"].get("content") or ""
                record.num_logprobs += len((choice.get("logprobs") or {}).get("content") or [])
                record.finish_reason = choice.get("finish_reason") or record.finish_reason
            num_chunks += 1
            if max_chunks is not None and num_chunks >= max_chunks:
                break
    return 200, records, usage


async def one_request(client: httpx.AsyncClient, kind: str, rng: random.Random,
                      refs: dict[str, str], tally: Tally) -> None:
    prompt = rng.choice(PROMPTS)
    if kind == "bad":
        body = rng.choice(BAD_BODIES)
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        response = await client.post(path, content=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
        client_error = 400 <= response.status_code < 500
        tally.count(kind, "4xx" if client_error else str(response.status_code))
        return
    if kind == "cancel":
        status, _, _ = await read_stream(client, chat_body(prompt), max_chunks=rng.randint(1, 6))
        tally.count(kind, str(status))
        return
    if kind == "plain":
        response = await client.post("/v1/chat/completions", json=chat_body(prompt))
        ok = response.status_code == 200
        same = ok and response.json()["choices"][0]["message"]["content"] == refs[prompt]
        if ok and not same:
            tally.problems.append(f"plain {prompt!r}: text differs from the reference")
        tally.count(kind, str(response.status_code))
        return
    await _checked_stream(client, kind, prompt, refs[prompt], tally)


async def _checked_stream(client: httpx.AsyncClient, kind: str, prompt: str, reference: str,
                          tally: Tally) -> None:
    """A greedy stream (kinds stream, n2, stop) checked token by token."""
    extra, expected, num_tokens = {}, reference, MAX_TOKENS
    if kind == "n2":
        extra = {"n": 2}
    stop = stop_for(reference) if kind == "stop" else None
    if stop is not None:
        extra, expected, num_tokens = {"stop": [stop]}, expected_before_stop(reference, stop), None
    status, records, usage = await read_stream(client, chat_body(prompt, **extra))
    tally.count(kind, str(status))
    if status != 200:
        return
    if num_tokens is None:  # a stop string: the text, and the finish reason
        problems = [f"choice {i}: {r.text!r} is not the reference cut at {stop!r}"
                    for i, r in records.items() if r.text != expected or r.finish_reason != "stop"]
    else:
        problems = token_problems(records, usage, expected, num_tokens)
    tally.problems.extend(f"{kind} {prompt!r}: {p}" for p in problems)


async def client_loop(url: str, seed: int, until: float, refs: dict[str, str],
                      tally: Tally) -> None:
    rng, kinds = random.Random(seed), pick_kinds(seed)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        while time.monotonic() < until:
            kind = next(kinds)
            unavailable = tally.outcomes[(kind, "503")]
            try:
                await one_request(client, kind, rng, refs, tally)
            except httpx.HTTPError as error:
                tally.count(kind, type(error).__name__)
            if tally.outcomes[(kind, "503")] > unavailable:
                await asyncio.sleep(0.5)  # no engine (it is restarting): do not spin


async def traffic(url: str, concurrency: int, seconds: float, refs: dict[str, str],
                  tally: Tally, seed: int) -> None:
    until = time.monotonic() + seconds
    await asyncio.gather(*(client_loop(url, seed + i, until, refs, tally)
                           for i in range(concurrency)))
