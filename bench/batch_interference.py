"""Interactive TTFT while a batch runs: does batch work stay out of interactive traffic's way?

    .venv/bin/python -m bench batch-interference                 # ~2 min on 2 cores
    .venv/bin/python -m bench batch-interference --requests 40 --batch-lines 800

Starts the pipeline (tokenizer, engine, detok, gateway) and one batch worker with its
default lines in flight as processes (devkit/stack.py), then sends interactive streamed
completions one at a time (concurrency 1): first with nothing else running, then while a
batch runs. Prints both TTFT p50s, their ratio (the target is at most 1.5x) and the
batch's own throughput during the second window; `--out` writes them as a Markdown section
(the suite's docs/img/batch_interference.md, which docs/benchmarks.md includes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.serving.client import send_completion  # noqa: E402
from devkit.local_redis import ensure_redis  # noqa: E402
from devkit.stack import PIPELINE, Stack, StackSpec  # noqa: E402

MODEL = "smollm2-135m-instruct"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20, help="interactive requests per window")
    parser.add_argument("--batch-lines", type=int, default=400)
    parser.add_argument("--max-tokens", type=int, default=16, help="of every request and line")
    parser.add_argument("--log-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None, help="also write the section here")
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv  # the command line, for the section
    return args


def stack_spec(log_dir: Path, files_dir: Path) -> StackSpec:
    """Every process on free ports, a batch worker, and Redis keys of this run only."""
    return StackSpec(log_dir, model=MODEL, services=(*PIPELINE, "batch"),
                     env={"HF_HUB_OFFLINE": "1"},
                     redis_prefix=f"conveyor-bench-batch-{os.getpid()}", files_dir=files_dir)


def interactive_body(i: int, max_tokens: int) -> dict:
    prompt = (f"Request {i}. Conveyor belts move boxes from the loading dock to the trucks; "
              "explain in one paragraph how a sorting station decides where each box goes.")
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}


async def ttfts(url: str, num: int, max_tokens: int) -> list[float]:
    """TTFT of `num` streamed completions sent one after another."""
    times = []
    async with httpx.AsyncClient(timeout=300) as client:
        for i in range(num):
            result = await send_completion(client, f"{url}/v1/completions",
                                           interactive_body(i, max_tokens), 0)
            if not result.success:
                raise RuntimeError(f"interactive request failed: {result.error}")
            times.append(result.ttft)
    return times


def batch_input(num_lines: int, max_tokens: int) -> bytes:
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": MODEL, "prompt": f"Line {i}: write a short story about a robot "
                       "that sorts parcels at night.", "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True}} for i in range(num_lines)]
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def submit_batch(client: httpx.Client, num_lines: int, max_tokens: int) -> str:
    upload = client.post("/v1/files", data={"purpose": "batch"},
                         files={"file": ("bench.jsonl", batch_input(num_lines, max_tokens))})
    upload.raise_for_status()
    batch = client.post("/v1/batches", json={"input_file_id": upload.json()["id"],
                                             "endpoint": "/v1/completions",
                                             "completion_window": "24h"})
    batch.raise_for_status()
    return batch.json()["id"]


def lines_done(client: httpx.Client, batch_id: str) -> tuple[str, int]:
    batch = client.get(f"/v1/batches/{batch_id}").json()
    return batch["status"], batch["request_counts"]["completed"] + batch["request_counts"]["failed"]


def wait_until_running(client: httpx.Client, batch_id: str, min_done: int) -> None:
    deadline = time.monotonic() + 300
    while lines_done(client, batch_id)[1] < min_done:
        if time.monotonic() > deadline:
            raise RuntimeError("the batch did not start within 300 s")
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(ensure_redis(), file=sys.stderr)
    with (tempfile.TemporaryDirectory() as tmp,
          Stack(stack_spec(args.log_dir or Path(tmp) / "logs", Path(tmp) / "files")) as stack):
        url = stack.base_url
        asyncio.run(ttfts(url, 2, args.max_tokens))  # warm-up
        alone = asyncio.run(ttfts(url, args.requests, args.max_tokens))
        with httpx.Client(base_url=url, timeout=60) as client:
            batch_id = submit_batch(client, args.batch_lines, args.max_tokens)
            wait_until_running(client, batch_id, 8)
            _, done_before = lines_done(client, batch_id)
            started = time.monotonic()
            during = asyncio.run(ttfts(url, args.requests, args.max_tokens))
            seconds = time.monotonic() - started
            status, done_after = lines_done(client, batch_id)
            client.post(f"/v1/batches/{batch_id}/cancel")
    report(args, alone, during, done_after - done_before, seconds, status)
    return 0


TARGET_RATIO = 1.5
"""Interactive TTFT p50 with a batch running, at most this many times its p50 alone."""


def report(args: argparse.Namespace, alone: list[float], during: list[float], num_lines: int,
           seconds: float, status: str) -> None:
    p50_alone, p50_during = statistics.median(alone), statistics.median(during)
    ratio = p50_during / p50_alone
    print(json.dumps({"ttft_p50_alone_s": p50_alone, "ttft_p50_with_batch_s": p50_during,
                      "ratio": ratio, "batch_lines_during": num_lines,
                      "batch_lines_per_s": num_lines / seconds,
                      "batch_status_at_end": status}, indent=2))
    command = " ".join(["HF_HUB_OFFLINE=1 .venv/bin/python -m bench batch-interference",
                        *args.argv])
    markdown = "\n".join([
        "## Batch work beside interactive traffic", "",
        f"`{command}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: the four "
        f"services and one batch worker (its default lines in flight) on this machine's "
        f"{os.cpu_count()} CPUs; {args.requests} interactive streamed completions a window, one "
        f"at a time, max_tokens {args.max_tokens}; a batch of {args.batch_lines} lines, "
        f"{status} when the window ended.", "",
        "| interactive TTFT p50, no batch | with a batch running | ratio | target | batch "
        "lines/s meanwhile |", "|---|---|---|---|---|",
        f"| {p50_alone * 1000:.0f} ms | {p50_during * 1000:.0f} ms | {ratio:.2f}x | "
        f"<= {TARGET_RATIO}x ({'met' if ratio <= TARGET_RATIO else 'not met'}) | "
        f"{num_lines / seconds:.1f} |", ""])
    print("\n" + markdown)
    if args.out:
        args.out.write_text(markdown)
    if status != "in_progress":
        print("warning: the batch ended before the window did; use more --batch-lines",
              file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
