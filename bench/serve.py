"""`python -m bench serve`: streamed completions against a server, on the named scenarios.

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench serve --scenario c1,c16 --in-process
    .venv/bin/python -m bench serve --base-url http://127.0.0.1:8000 --scenario c16
    HF_HUB_OFFLINE=1 .venv/bin/python -m bench serve --rounds 3 --in-process \\
        --variant old@ed575d7 --variant new

Without `--base-url` it starts Conveyor's four services (devkit's stack launcher, the engine
as the peer comparison runs it) and reads every process's CPU seconds from /proc around each
scenario: CPU ms per output token of the engine, gateway, detok, tokenizer, the load
generator ("client") and everything else on the machine ("others"; a scenario where they
kept more than 0.15 cores busy is logged as DISTURBED). With `--in-process` the engine also
runs in this process (the services idle beside it) with the same settings; each scenario
runs `--pairs` times on both, back to back on the same prompts, and reports served TPOT over
in-process TPOT (the median over pairs): what the pipeline adds to a token. `--engine-cpus`
gives the engine's threads CPUs of their own in both arms (with `--threads` to match). With
`--variant` the run is an A/B (bench/ab.py): `NAME@REV` runs revision REV's services.
Settings reach the services through the environment (CONVEYOR_ENGINE_WEIGHT_FORMAT=...).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
from pathlib import Path

from bench.offline import add_common_args, child_argv, profile_of, scenario_figures


def cpu_figures(out: dict) -> dict[str, float]:
    """{"c1 CPU ms/token gateway": ...}: each process's CPU per output token, per scenario."""
    figures = {}
    for name, scenario in out["scenarios"].items():
        tokens = max(scenario["total_output_tokens"], 1)
        spent = {**scenario["cpu_s"], "others": scenario["others_cpu_s"]}
        figures |= {f"{name} CPU ms/token {process}": 1e3 * seconds / tokens
                    for process, seconds in spent.items()}
    return figures


def in_process_ratios(served: dict[str, float], alone: dict[str, float]) -> dict[str, float]:
    """Each scenario's served TPOT p50 over the in-process engine's."""
    suffix = " TPOT p50 ms"
    return {key.replace(suffix, " served/in-process TPOT"): value / alone[key]
            for key, value in served.items() if key.endswith(suffix) and alone.get(key)}


def paired_figures(served, alone, maker, profile, names: tuple[str, ...], pairs: int,
                   log=print) -> dict[str, float]:
    """Each scenario `pairs` times on both targets, back to back on the same fresh prompts,
    alternating which goes first: the served figures and served/in-process ratios of each
    pair, their median over pairs. Both arms see the same drift in the machine's speed (the
    in-process c1 TPOT moved 4.95 -> 6.84 ms over three rounds minutes apart on one VM)."""
    from bench.serving.workload import scenario_requests
    from bench.suite.scenarios import run_scenario, warm

    for target in (served, alone):
        warm(target, maker, profile)
    per_pair: list[dict[str, float]] = [{} for _ in range(pairs)]
    for seed, scenario in enumerate(profile.scenarios):
        if scenario.name not in names:
            continue
        for pair, figures in enumerate(per_pair):
            requests = scenario_requests(maker, profile, scenario, seed + 1000 * pair)
            outs = {target.name: {"scenarios": {scenario.name: run_scenario(
                target, requests, scenario, profile.scenario_duration_s, log)}}
                for target in ((served, alone) if pair % 2 == 0 else (alone, served))}
            mine = scenario_figures(outs[served.name]) | cpu_figures(outs[served.name])
            figures |= mine | in_process_ratios(mine, scenario_figures(outs[alone.name]))
    keys = [key for key in per_pair[0] if all(key in f for f in per_pair)]  # failed runs lack some
    return {key: statistics.median(f[key] for f in per_pair) for key in keys}


def set_affinity(pid: int, cpus: set[int]) -> None:
    """Every thread of process `pid` onto `cpus` (affinity is per thread on Linux)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cpus)


class OnCpus:
    """A target whose runs hold this process's threads on `cpus`, and on `rest` after."""

    def __init__(self, target, cpus: set[int], rest: set[int]):
        self.target, self.cpus, self.rest = target, cpus, rest
        self.name = target.name

    def run(self, *args, **kwargs):
        set_affinity(os.getpid(), self.cpus)
        try:
            return self.target.run(*args, **kwargs)
        finally:
            set_affinity(os.getpid(), self.rest)


def pin_engine(target, alone, engine_cpus: set[int]):
    """The served engine's threads on `engine_cpus`, the other services' and this process's on
    the other CPUs; the in-process engine (`alone`) runs on `engine_cpus` too."""
    rest = set(os.sched_getaffinity(0)) - engine_cpus
    for name, pid in target.pids.items():
        set_affinity(pid, engine_cpus if name == "engine" else rest)
    set_affinity(os.getpid(), rest)
    return OnCpus(alone, engine_cpus, rest)


def measure(args: argparse.Namespace) -> dict[str, float]:
    from bench.serving.workload import load_prompt_maker
    from bench.suite.scenarios import run_system
    from bench.suite.targets import HttpTarget, InProcessTarget, conveyor_pipeline

    profile, names = profile_of(args)
    maker = load_prompt_maker()
    if args.base_url:
        target = HttpTarget("server", args.base_url, os.environ.get("BENCH_API_KEY"))
        return scenario_figures(run_system(target, maker, profile, names))
    from bench.suite.peer_comparison import CONVEYOR_ENV

    os.environ.update(CONVEYOR_ENV)  # the services and the in-process engine read the same
    if args.threads:
        os.environ["CONVEYOR_ENGINE_TORCH_THREADS"] = str(args.threads)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    print(f"service logs in {log_dir}", flush=True)
    with conveyor_pipeline(log_dir) as target:
        if not args.in_process:
            out = run_system(target, maker, profile, names)
            return scenario_figures(out) | cpu_figures(out)
        from bench.inprocess_engine import make_llm

        alone = InProcessTarget("in-process", make_llm())  # beside the idle services
        if args.engine_cpus:
            alone = pin_engine(target, alone, args.engine_cpus)
        return paired_figures(target, alone, maker, profile, names, args.pairs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, "c1,c16")
    p.add_argument("--base-url", default=None,
                   help="an OpenAI-compatible server to drive (default: start Conveyor's)")
    p.add_argument("--in-process", action="store_true",
                   help="also run the engine alone on the same prompts (served/in-process)")
    p.add_argument("--pairs", type=int, default=3,
                   help="--in-process: served and in-process runs of each scenario, "
                   "alternating, on fresh prompts each pair (figures: medians)")
    p.add_argument("--engine-cpus", type=lambda text: {int(c) for c in text.split(",")},
                   default=set(), help="--in-process: CPUs (0,1,...) for the engine's threads, "
                   "served and in process; everything else runs on the other CPUs")
    args = p.parse_args(argv)
    if args.engine_cpus and not (args.in_process
                                 and args.engine_cpus < set(os.sched_getaffinity(0))):
        p.error("--engine-cpus goes with --in-process and leaves this machine a CPU for the rest")
    if args.pairs < 1:
        p.error("--pairs takes a count of 1 or more")
    if args.base_url and args.in_process:
        p.error("--in-process compares with Conveyor's own engine: it needs the stack this "
                "command starts, not --base-url")
    if args.variant:
        from bench import ab

        flags = [*(["--base-url", args.base_url] if args.base_url else []),
                 *(["--in-process", "--pairs", str(args.pairs)] if args.in_process else []),
                 *(["--engine-cpus", ",".join(map(str, sorted(args.engine_cpus)))]
                   if args.engine_cpus else [])]
        ab.compare(args.variant, args.rounds, child_argv("serve", args, tuple(flags)), args.out)
        return 0
    from bench.ab import format_figures

    figures = measure(args)
    print(format_figures(figures))
    if args.json_out:
        args.json_out.write_text(json.dumps(figures))
    return 0
