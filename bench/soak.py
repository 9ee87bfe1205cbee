"""Soak: mixed traffic for a long while, then proof that nothing leaked or drifted.

    .venv/bin/python -m bench soak                  # the documented run: 20 minutes
    .venv/bin/python -m bench soak --minutes 3      # a short check

Starts the pipeline (tokenizer, engine, detok, gateway) as processes with the bundled
model (devkit/stack.py), then keeps `--concurrency` clients busy with a seeded mix
(bench/soak_traffic.py): greedy streams, streams closed after a few chunks (cancels),
n = 2, stop strings, plain requests and bad inputs; a bar on stderr counts the seconds of
traffic. The engine is restarted once, under traffic, after the first warm-up; the gateway
finds the new one through the Redis registry. At the end it checks, and prints as Markdown:

- memory: each service's RSS at the end within 10% of its level after warm-up (the
  engine's counted from its restart);
- tokens: every greedy stream's text equals its prompt's reference (taken before the run),
  with one logprobs entry per token and usage.completion_tokens equal to that count, so no
  token was lost or duplicated; stop strings cut exactly before the stop;
- counters: engine running, waiting and free KV blocks, and the quota slots and
  reservations in Redis, back to their values before the traffic.

Exit status 1 when a check fails. Not part of the test suite (bench/tests/test_soak_traffic.py
tests the traffic's pure helpers).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
from redis import Redis
from tqdm import tqdm

from bench.soak_traffic import KINDS, MODEL, STREAM_ERROR, Tally, references, traffic
from conveyor.common.grpc_client import open_channel
from conveyor.v1 import engine_pb2, engine_pb2_grpc
from devkit.local_redis import ensure_redis, redis_url
from devkit.stack import Stack, StackSpec

REDIS_URL = redis_url()
RSS_TOLERANCE = 0.10


def rss_drift(baseline: int, final: int) -> float:
    """Relative change of RSS from its level after warm-up."""
    return (final - baseline) / baseline


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
    refs = await references(url)
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
