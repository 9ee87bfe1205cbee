"""The suite's serving workloads, each a function of a target and a profile.

Every function returns plain dicts (JSON-ready) so the report can be rebuilt from a
saved results file.
"""

from __future__ import annotations

import time

from bench.serving.metrics import format_metrics
from bench.serving.workload import PromptMaker
from bench.suite.profile import Profile


class SweepOverBudget(Exception):
    """The sweep stopped early; `points` holds the levels it measured."""

    def __init__(self, points: list[dict], message: str):
        super().__init__(message)
        self.points = points


def concurrency_sweep(target, maker: PromptMaker, profile: Profile, log=print) -> list[dict]:
    """Random prompts (input_len in, output_len out, ignore_eos) at each concurrency.

    A short burst first (not measured) lets the server reach its steady state: threads
    spun up, kernels chosen for several batch sizes, KV memory touched.
    """
    start = time.monotonic()
    burst = min(max(profile.concurrency_levels), 16)
    target.run(maker.random_requests(burst, profile.input_len, 4), burst, num_warmup=0)
    points = []
    for concurrency in profile.concurrency_levels:
        if time.monotonic() - start > profile.sweep_budget_s:
            skipped = [c for c in profile.concurrency_levels if c >= concurrency]
            raise SweepOverBudget(points, f"concurrency {skipped} skipped: the sweep ran past "
                                  f"its {profile.sweep_budget_s:.0f} s budget")
        num = profile.num_prompts(concurrency)
        requests = maker.random_requests(num, profile.input_len, profile.output_len)
        metrics, results = target.run(requests, concurrency, num_warmup=1,
                                duration_s=profile.level_duration_s)
        log(format_metrics(f"{target.name} concurrency {concurrency}", metrics))
        _check_prompt_counts(target.name, results, log)
        points.append({"concurrency": concurrency, **metrics.as_dict()})
    return points


def prefix_cold_warm(target, maker: PromptMaker, profile: Profile, log=print) -> dict:
    """TTFT at concurrency 1 for prefix_len-token system prompts + distinct questions.

    Cold: every request has its own system prompt, so nothing is cached. Warm: one system
    prompt, sent once before measuring, then shared by every measured request.
    """
    num, question, out = profile.prefix_requests, profile.prefix_question_len, 8
    target.run(maker.random_requests(1, 16, 4), 1, num_warmup=0)  # the server is warm
    cold = [maker.shared_prefix_requests(1, profile.prefix_len, question, out)[0]
            for _ in range(num)]
    warm = maker.shared_prefix_requests(num + 1, profile.prefix_len, question, out)
    cold_metrics, _ = target.run(cold, 1, num_warmup=0)
    target.run(warm[:1], 1, num_warmup=0)
    warm_metrics, _ = target.run(warm[1:], 1, num_warmup=0)
    result = {"prefix_len": profile.prefix_len, "question_len": question, "num_requests": num,
              "cold": cold_metrics.as_dict(), "warm": warm_metrics.as_dict()}
    log(f"{target.name} prefix {profile.prefix_len}: TTFT p50 cold "
        f"{cold_metrics.ttft.p50:.1f} ms, warm {warm_metrics.ttft.p50:.1f} ms")
    return result


def _check_prompt_counts(name: str, results, log) -> None:
    """Warn when the server counted prompt tokens differently from the benchmark."""
    off = [r for r in results if r.prompt_tokens_reported not in (None, r.prompt_len)]
    if off:
        log(f"WARNING {name}: {len(off)} requests' usage.prompt_tokens differ from the prompt "
            f"length (e.g. {off[0].prompt_tokens_reported} vs {off[0].prompt_len})")
