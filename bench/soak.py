"""Soak: mixed traffic for a long while, then proof that nothing leaked or drifted.

    .venv/bin/python bench/soak.py                  # the documented run: 20 minutes
    .venv/bin/python bench/soak.py --minutes 3      # a short check

Starts the pipeline (tokenizer, engine, detok, gateway) as processes with the bundled
model (devkit/stack.py), then keeps `--concurrency` clients busy with a seeded mix: greedy
streams, streams closed after a few chunks (cancels), n = 2, stop strings, plain requests
and bad inputs; a bar on stderr counts the seconds of traffic. The engine is restarted
once, under traffic, after the first warm-up; the gateway finds the new one through the
Redis registry. At the end it checks, and prints as Markdown:

- memory: each service's RSS at the end within 10% of its level after warm-up (the
  engine's counted from its restart);
- tokens: every greedy stream's text equals its prompt's reference (taken before the run),
  with one logprobs entry per token and usage.completion_tokens equal to that count, so no
  token was lost or duplicated; stop strings cut exactly before the stop;
- counters: engine running, waiting and free KV blocks, and the quota slots and
  reservations in Redis, back to their values before the traffic.

Exit status 1 when a check fails. Not part of the test suite (bench/tests/test_soak.py
tests its pure helpers).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
from redis import Redis
from tqdm import tqdm

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.serving.client import parse_sse_line  # noqa: E402
from conveyor.common.grpc_client import open_channel  # noqa: E402
from conveyor.v1 import engine_pb2, engine_pb2_grpc  # noqa: E402
from devkit.local_redis import ensure_redis, redis_url  # noqa: E402
from devkit.stack import Stack, StackSpec  # noqa: E402

MODEL = "smollm2-135m-instruct"
REDIS_URL = redis_url()
RSS_TOLERANCE = 0.10
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


# -- pure helpers (tested in bench/tests/test_soak.py) -----------------------------------------

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


def rss_drift(baseline: int, final: int) -> float:
    """Relative change of RSS from its level after warm-up."""
    return (final - baseline) / baseline


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


# -- the stack ----------------------------------------------------------------------------------

ENGINE_SETTINGS = {"MAX_MODEL_LEN": "2048", "ENGINE_ID": "soak-engine", "DTYPE": "float32"}
"""float32: the token check compares greedy text across batches, which float32 keeps equal;
dtype auto is bfloat16 on a CPU with AMX or AVX512-BF16, whose greedy output moves with the
batch a request shares (as tests/conftest.py's engine)."""


def stack_spec(log_dir: Path, prefix: str) -> StackSpec:
    """The pipeline with its replicas registered under `prefix`: the restarted engine comes
    back under the same id at a new port, and the gateway finds it in the registry."""
    return StackSpec(log_dir, model=MODEL, engine=ENGINE_SETTINGS, env={"HF_HUB_OFFLINE": "1"},
                     redis_url=REDIS_URL, redis_prefix=prefix)


def rss(stack: Stack) -> dict[str, int]:
    """Each service's resident memory, by name."""
    return {name: psutil.Process(pid).memory_info().rss for name, pid in stack.pids.items()}


# -- counters -----------------------------------------------------------------------------------

async def engine_counters(address: str) -> dict[str, int]:
    channel = open_channel(address)
    try:
        stats = await engine_pb2_grpc.EngineStub(channel).Stats(engine_pb2.EngineStatsRequest(),
                                                                timeout=5)
    finally:
        await channel.close()
    return {"running": stats.num_running, "waiting": stats.num_waiting,
            "kv_blocks_in_use": stats.num_blocks - stats.num_free_blocks}


def quota_counters(prefix: str) -> dict[str, int]:
    redis = Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        slots = sum(redis.zcard(key) for key in redis.scan_iter(f"{prefix}:quota:*:concurrency"))
        reservations = sum(1 for _ in redis.scan_iter(f"{prefix}:quota:*:rsv:*"))
    finally:
        redis.close()
    return {"quota_slots": slots, "quota_reservations": reservations}


async def counters(stack: Stack) -> dict[str, int]:
    engine = await engine_counters(stack.processes["engine"].address)
    return {**engine, **quota_counters(stack.redis_prefix)}


async def settled_counters(stack: Stack, timeout_s: float = 60.0) -> dict[str, int]:
    """The counters once every one is back to zero, or as they are at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = await counters(stack)
        if not any(now.values()) or time.monotonic() > deadline:
            return now
        await asyncio.sleep(0.2)


# -- traffic ------------------------------------------------------------------------------------

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


async def references(client: httpx.AsyncClient) -> dict[str, str]:
    """Each prompt's greedy text (non-streamed), taken before the traffic."""
    out = {}
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


# -- the run ------------------------------------------------------------------------------------

@dataclass
class SoakResult:
    minutes: float
    tally: Tally
    rss_baseline: dict[str, int]
    rss_final: dict[str, int]
    counters_before: dict[str, int]
    counters_after: dict[str, int]
    restart_s: float

    @property
    def failures(self) -> list[str]:
        out = [f"{name} RSS drifted {rss_drift(self.rss_baseline[name], final):+.1%}"
               for name, final in self.rss_final.items()
               if abs(rss_drift(self.rss_baseline[name], final)) > RSS_TOLERANCE]
        out += [f"{name} is {value}, was {self.counters_before[name]}"
                for name, value in self.counters_after.items()
                if value != self.counters_before[name]]
        out += self.tally.problems[:20]
        unexpected = [f"{kind}: {outcome} x{n}" for (kind, outcome), n in
                      self.tally.outcomes.items() if outcome not in _EXPECTED[kind]]
        return out + [f"unexpected outcome {u}" for u in unexpected]


_EXPECTED = {kind: {"200", "503", STREAM_ERROR} for kind in KINDS} | {"bad": {"4xx"}}
"""Outcomes that are not failures (503 or a stream's error event around the restart)."""


async def soak(args: argparse.Namespace, stack: Stack) -> SoakResult:
    total_s, warm_s = args.minutes * 60, args.warmup_minutes * 60
    url, tally = stack.base_url, Tally()
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        refs = await references(client)
    before = await settled_counters(stack)
    async with progress_bar(max(total_s, 2 * warm_s)):
        await traffic(url, args.concurrency, warm_s, refs, tally, args.seed)
        restarted = time.monotonic()
        restart = asyncio.create_task(asyncio.to_thread(stack.restart_engine))
        await traffic(url, args.concurrency, warm_s, refs, tally, args.seed + 100)
        await restart
        restart_s = time.monotonic() - restarted
        baseline = rss(stack)
        await traffic(url, args.concurrency, max(0.0, total_s - 2 * warm_s), refs, tally,
                      args.seed + 200)
    after = await settled_counters(stack)
    return SoakResult(args.minutes, tally, baseline, rss(stack), before, after, restart_s)


@contextlib.asynccontextmanager
async def progress_bar(seconds: float):
    """Seconds of traffic sent so far, of `seconds`, on stderr (not when it is no terminal)."""
    bar = tqdm(total=round(seconds), desc="soak", file=sys.stderr, disable=None,
               bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} s [{elapsed}<{remaining}]")
    started = time.monotonic()

    async def tick() -> None:
        while True:
            await asyncio.sleep(1)
            bar.update(min(bar.total, round(time.monotonic() - started)) - bar.n)

    ticking = asyncio.create_task(tick())
    try:
        yield
    finally:
        ticking.cancel()
        bar.close()


def markdown(result: SoakResult) -> str:
    lines = [f"Soak of {result.minutes:g} minutes (engine restarted under traffic, "
             f"{result.restart_s:.0f} s to come back).", "",
             "| service | RSS after warm-up (MiB) | RSS at the end (MiB) | drift |",
             "|---|---:|---:|---:|"]
    for name, final in result.rss_final.items():
        base = result.rss_baseline[name]
        lines.append(f"| {name} | {base / 2**20:.0f} | {final / 2**20:.0f} | "
                     f"{rss_drift(base, final):+.1%} |")
    lines += ["", "| counter | before | after |", "|---|---:|---:|"]
    lines += [f"| {name} | {result.counters_before[name]} | {value} |"
              for name, value in result.counters_after.items()]
    lines += ["", "| traffic | outcome | requests |", "|---|---|---:|"]
    lines += [f"| {kind} | {outcome} | {n} |"
              for (kind, outcome), n in sorted(result.tally.outcomes.items())]
    verdict = "; ".join(result.failures) or "every check passed"
    lines += ["", f"Token problems: {len(result.tally.problems)}. Verdict: {verdict}."]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=20.0, help="length of the whole run")
    parser.add_argument("--warmup-minutes", type=float, default=None,
                        help="before the restart, and again after it (default: minutes / 10, "
                        "at least 0.25)")
    parser.add_argument("--concurrency", type=int, default=4, help="clients sending at once")
    parser.add_argument("--seed", type=int, default=15)
    parser.add_argument("--log-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.warmup_minutes is None:
        args.warmup_minutes = max(0.25, args.minutes / 10)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(ensure_redis(REDIS_URL), file=sys.stderr)
    log_dir = args.log_dir or Path(f"/tmp/conveyor-soak-{os.getpid()}")
    with Stack(stack_spec(log_dir, f"conveyor-soak-{os.getpid()}")) as stack:
        result = asyncio.run(soak(args, stack))
    print(markdown(result))
    return 1 if result.failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
