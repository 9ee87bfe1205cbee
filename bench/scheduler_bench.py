"""Micro-benchmark: the scheduler's CPU cost per step (schedule() and update_from_output()).

Run from the repository root:

    .venv/bin/python bench/scheduler_bench.py

Two cases: 256 running requests decoding (one token each per step), and 1,000
requests arriving at once (admission, chunked prefill, then decode, with 744 left
waiting once max_num_seqs is reached). No model: a stand-in runner returns token
1 for every request that needs one, built outside the timed region. The figures
should be a small fraction of a model step (milliseconds on a GPU).
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time

from conveyor.engine.core.config import EngineConfig
from conveyor.engine.core.request import Request
from conveyor.engine.core.scheduler import Scheduler
from conveyor.engine.core.scheduler_output import ModelRunnerOutput, SampledToken
from conveyor.engine.sampling_params import SamplingParams

PROMPT_LEN = 512
MAX_TOKENS = 1024


def make_scheduler(num_requests: int) -> Scheduler:
    config = EngineConfig(
        num_blocks=256 * (PROMPT_LEN + MAX_TOKENS) // 16,
        block_size=16,
        max_model_len=PROMPT_LEN + MAX_TOKENS,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
    )
    scheduler = Scheduler(config, eos_token_ids=[2])
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    for i in range(num_requests):
        prompt = [i % 97 + 3] * 8 + list(range(i * 7, i * 7 + PROMPT_LEN - 8))
        scheduler.add_request(Request(f"req-{i}", prompt, params))
    return scheduler


def run_steps(scheduler: Scheduler, num_steps: int) -> tuple[list[float], list[float]]:
    """Seconds spent in schedule() and update_from_output() for each of num_steps steps."""
    schedule_s: list[float] = []
    update_s: list[float] = []
    for _ in range(num_steps):
        start = time.perf_counter()
        output = scheduler.schedule()
        middle = time.perf_counter()
        sampled = {s.request_id: [SampledToken(1)] for s in output.scheduled if s.needs_sample}
        runner_output = ModelRunnerOutput(sampled)
        before_update = time.perf_counter()
        scheduler.update_from_output(output, runner_output)
        end = time.perf_counter()
        schedule_s.append(middle - start)
        update_s.append(end - before_update)
    return schedule_s, update_s


def report(name: str, schedule_s: list[float], update_s: list[float]) -> None:
    """p50 is the figure to quote; p99 and mean include noise from other processes."""

    def ms(values: list[float], q: float) -> float:
        return sorted(values)[int(q * (len(values) - 1))] * 1e3

    total = [a + b for a, b in zip(schedule_s, update_s, strict=True)]
    print(
        f"{name:<44} schedule p50 {ms(schedule_s, 0.5):6.3f} p99 {ms(schedule_s, 0.99):6.3f}"
        f" | update p50 {ms(update_s, 0.5):6.3f} | both p50 {ms(total, 0.5):6.3f}"
        f" min {min(total) * 1e3:6.3f} mean {statistics.fmean(total) * 1e3:6.3f} ms"
        f" ({len(total)} steps)"
    )


def bench_running(num_steps: int) -> None:
    scheduler = make_scheduler(256)
    run_steps(scheduler, 3)  # admit and prefill all 256 (8192-token budget per step)
    while any(r.num_tokens_to_compute > 1 for r in scheduler.running):
        run_steps(scheduler, 1)
    assert scheduler.num_running == 256 and scheduler.num_waiting == 0
    report("256 running, decode", *run_steps(scheduler, num_steps))


def bench_waiting(num_steps: int) -> None:
    scheduler = make_scheduler(1000)
    schedule_s, update_s = run_steps(scheduler, num_steps)
    assert scheduler.num_waiting == 1000 - 256
    num_prefill = 256 * PROMPT_LEN // 8192  # steps until all 256 admitted prompts are in
    report("1,000 arrive: admit + prefill 8,192 tok/step", schedule_s[:num_prefill],
           update_s[:num_prefill])
    report("then 256 running, 744 waiting", schedule_s[num_prefill:], update_s[num_prefill:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="timed steps per case")
    args = parser.parse_args()
    print("command:", shlex.join([sys.executable, *sys.argv]))
    print(f"prompt {PROMPT_LEN} tokens, block_size 16, budget 8192 tokens, max_num_seqs 256")
    bench_running(args.steps)
    bench_waiting(args.steps)


if __name__ == "__main__":
    main()
