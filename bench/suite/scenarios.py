"""The peer comparison's workloads: every system gets the same prompts, scenario by scenario.

Each scenario builds its requests from its own seed, so the prompts (and the shared prefix)
are identical for every system. One request outside the measured set goes first, alone: it
warms the server and, in a shared-prefix scenario, puts the prefix in its cache, as a
long-lived server with that system prompt would have it.
"""

from __future__ import annotations

import time

from bench.serving.metrics import format_metrics
from bench.serving.workload import (
    BenchRequest,
    Profile,
    PromptMaker,
    Scenario,
    scenario_requests,
)
from bench.suite import cpu_time

DISTURBED_CORES = 0.15
"""Other processes' CPU over a scenario's duration, in cores, past which its figures are
flagged as disturbed (logged, and listed under the report's table). The servers' threads fill
the cores, so another process's CPU stalls every step on a descheduled thread: a compiler
alongside the 2-thread engine made an in-process mixed run 3x slower (63 s against 21 s).
Quiet served runs measure 0.03-0.04 (Redis, daemons). Not run again: a second run on the
same server would find its prompts in the prefix cache."""


def run_scenario(target, requests: list[BenchRequest], scenario: Scenario,
                 duration_s: float | None = None, log=print) -> dict:
    """Metrics (as a dict) of one scenario, with the CPU seconds each process spent on it and
    those of the other processes on the machine (`others_cpu_s`)."""
    target.run(requests[:1], 1, num_warmup=0, ignore_eos=scenario.ignore_eos)
    pids = getattr(target, "pids", {})
    before, machine_before = cpu_time.snapshot(pids), cpu_time.machine_busy_s()
    metrics, _ = target.run(requests[1:], scenario.concurrency, num_warmup=0,
                            duration_s=duration_s, ignore_eos=scenario.ignore_eos)
    cpu = cpu_time.spent(before, cpu_time.snapshot(pids))
    others = cpu_time.others_s(cpu, cpu_time.machine_busy_s() - machine_before)
    log(format_metrics(f"{target.name} {scenario.name}", metrics))
    log("CPU s: " + ", ".join(f"{k} {v:.1f}" for k, v in cpu.items())
        + f"; other processes {others:.1f}")
    figures = {"scenario": scenario.name, "concurrency": scenario.concurrency,
               "prefix_len": scenario.prefix_len, "mixed": scenario.mixed,
               **metrics.as_dict(), "cpu_s": cpu, "others_cpu_s": others,
               "cpu_s_per_request": {k: v / max(metrics.completed, 1) for k, v in cpu.items()}}
    if others_cores(figures) > DISTURBED_CORES:
        log(f"{target.name} {scenario.name}: DISTURBED: other processes kept "
            f"{others_cores(figures):.2f} cores busy; its figures are low")
    return figures


def others_cores(figures: dict) -> float:
    """Cores the machine's other processes kept busy during the scenario, on average."""
    return figures.get("others_cpu_s", 0.0) / max(figures["duration_s"], 1e-9)


def warm(target, maker: PromptMaker, profile: Profile) -> None:
    """A burst, not measured: threads spun up, kernels chosen for a few batch sizes."""
    burst = 16
    target.run(PromptMaker(maker.tokenizer, 99).random_requests(burst, profile.input_len, 4),
               burst, num_warmup=0)


def run_system(target, maker: PromptMaker, profile: Profile, names: tuple[str, ...],
               log=print) -> dict:
    """The named scenarios against one system, in the profile's order, within its budget:
    {"scenarios": {name: figures}, "skipped": [names], "seconds": wall time}."""
    start = time.monotonic()
    warm(target, maker, profile)
    out: dict = {"scenarios": {}, "skipped": []}
    for seed, scenario in enumerate(profile.scenarios):
        if scenario.name not in names:
            continue
        if time.monotonic() - start > profile.system_budget_s:
            out["skipped"].append(scenario.name)
            continue
        out["scenarios"][scenario.name] = run_scenario(
            target, scenario_requests(maker, profile, scenario, seed), scenario,
            profile.scenario_duration_s, log)
    out["seconds"] = time.monotonic() - start
    if out["skipped"]:
        log(f"{target.name}: {out['skipped']} skipped, past the {profile.system_budget_s:.0f} s "
            "budget")
    return out

