"""`python -m bench offline`: the engine in process (no services), on the named scenarios.

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench offline --scenario c1,c16 --threads 2
    HF_HUB_OFFLINE=1 .venv/bin/python -m bench offline --rounds 3 \\
        --variant fp32=CONVEYOR_ENGINE_DTYPE=float32 --variant bf16=CONVEYOR_ENGINE_DTYPE=bfloat16
    HF_HUB_OFFLINE=1 .venv/bin/python -m bench offline --steps --variant base@HEAD~1 --variant new

The engine is driven in a closed loop at each scenario's concurrency (bench/inprocess_engine.py)
and its figures go through the serving benchmark's metric code: output tok/s, TTFT and TPOT
p50 per scenario. Engine settings come from the environment (CONVEYOR_ENGINE_*), which is how
a variant sets them. `--steps` times single engine steps instead (the median decode step at
each concurrency over 256-token contexts, and a prefill step of 2,048 tokens): the quickest
A/B signal for a change inside a step; greedy unless `--sampling` sets the requests'
SamplingParams (`--sampling temperature=1,top_p=0.9`); `--profile` runs the timed decode steps
under cProfile and prints where their time goes, function by function (torch ops and native
kernels included). With `--variant` the run is an A/B (bench/ab.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

FIGURES = {"output_throughput": "tok/s", "p50_ttft_ms": "TTFT p50 ms",
           "p50_tpot_ms": "TPOT p50 ms"}
"""The figures of a scenario that a run reports (keys of BenchmarkMetrics.as_dict())."""


def add_common_args(p: argparse.ArgumentParser, default_scenarios: str) -> None:
    """The options `offline` and `serve` share: scenarios, sizes, threads and the A/B."""
    p.add_argument("--scenario", default=default_scenarios,
                   help="comma-separated names from bench/serving/workload.py (c1, c16, "
                   "c16-prefix, mixed, c64, c64-prefix)")
    p.add_argument("--quick", action="store_true", help="the quick sizes (a smoke run)")
    p.add_argument("--threads", type=int, default=0,
                   help="the engine's torch threads (0: the engine's choice)")
    p.add_argument("--variant", action="append", default=[],
                   help="NAME[@REV][=KEY=VALUE,...], repeated: an A/B run (bench/ab.py)")
    p.add_argument("--rounds", type=int, default=3, help="A/B rounds")
    p.add_argument("--out", type=Path, default=None, help="A/B: every run and the summary")
    p.add_argument("--json-out", type=Path, default=None, help="this run's figures as JSON")


def child_argv(command: str, args: argparse.Namespace, flags: tuple[str, ...] = ()) -> list[str]:
    """The arguments one A/B run gets: these, less the A/B's own."""
    argv = [command, "--scenario", args.scenario, "--threads", str(args.threads)]
    return argv + (["--quick"] if args.quick else []) + list(flags)


def profile_of(args: argparse.Namespace):
    from bench.serving.workload import FULL, QUICK

    profile = QUICK if args.quick else FULL
    names = args.scenario.split(",")
    unknown = set(names) - {s.name for s in profile.scenarios}
    if unknown:
        raise SystemExit(f"unknown scenario(s) {sorted(unknown)} in the {profile.name} sizes")
    return profile, tuple(names)


def scenario_figures(out: dict) -> dict[str, float]:
    """{"c1 TPOT p50 ms": ...} from run_system's output."""
    return {f"{name} {label}": figures[key] for name, figures in out["scenarios"].items()
            for key, label in FIGURES.items()}


def make_llm(threads: int):
    from bench.inprocess_engine import make_llm

    return make_llm(max_num_seqs=64, kv_cache_gib=1.0, max_model_len=2048,
                    **({"torch_threads": threads} if threads else {}))


def measure(args: argparse.Namespace) -> dict[str, float]:
    from bench.serving.workload import load_prompt_maker
    from bench.suite.scenarios import run_system
    from bench.suite.targets import InProcessTarget

    profile, names = profile_of(args)
    target = InProcessTarget("in-process", make_llm(args.threads))
    return scenario_figures(run_system(target, load_prompt_maker(), profile, names))


def measure_steps(args: argparse.Namespace) -> dict[str, float]:
    """Median ms of single steps: decode at each scenario's concurrency over 256-token
    contexts, and (from a scenario of 8 or more) a full prefill step of 2,048 tokens."""
    from bench.serving.workload import load_prompt_maker
    from conveyor.engine.engine_request import EngineRequest
    from conveyor.engine.sampling_params import SamplingParams

    llm, maker = make_llm(args.threads), load_prompt_maker()
    params = SamplingParams(**{"temperature": 0.0, **sampling_fields(args.sampling)},
                            max_tokens=1000, ignore_eos=True)
    profile, names = profile_of(args)
    figures = {}
    for name in names:
        n = profile.scenario(name).concurrency
        for i in range(n):
            llm.core.add_request(EngineRequest(f"{name}-{i}", maker.random_ids(256), params))
        prefill = _median_step_ms(llm, -(-n * 256 // 2048))  # the default 2,048-token budget
        if n >= 8:
            figures["prefill step ms"] = prefill
        _median_step_ms(llm, 2)
        with _profiled(args.profile, f"{name} decode steps"):
            figures[f"{name} decode step ms"] = _median_step_ms(llm, 9)
        llm.core.abort(llm.core.unfinished_request_ids)
        llm.core.step()
    return figures


def sampling_fields(text: str) -> dict[str, float]:
    """"temperature=1,top_p=0.9" -> {"temperature": 1.0, "top_p": 0.9} (top_k an int);
    ValueError for an entry that is not a numeric SamplingParams field."""
    from dataclasses import fields

    from bench.ab import key_values
    from conveyor.engine.sampling_params import SamplingParams

    pairs = key_values(text, "--sampling")
    unknown = set(pairs) - {f.name for f in fields(SamplingParams)}
    if unknown:
        raise ValueError(f"--sampling: {sorted(unknown)} are not SamplingParams fields")
    return {key: int(value) if key == "top_k" else float(value) for key, value in pairs.items()}


@contextmanager
def _profiled(enabled: bool, title: str):
    """cProfile around the block when `enabled`, then its functions by own time: torch ops and
    the native kernels (pybind calls, which torch.profiler does not see) appear by name."""
    if not enabled:
        yield
        return
    import cProfile
    import pstats

    with cProfile.Profile() as prof:
        yield
    print(f"--- {title}")
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def _median_step_ms(llm, count: int) -> float:
    times = []
    for _ in range(count):
        start = time.perf_counter()
        llm.core.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench offline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, "c1,c16")
    p.add_argument("--steps", action="store_true", help="time single steps (see above)")
    p.add_argument("--sampling", default="",
                   help="with --steps: the requests' SamplingParams as KEY=VALUE,... "
                   "(temperature=1,top_p=0.9; default greedy)")
    p.add_argument("--profile", action="store_true",
                   help="with --steps: the decode steps under cProfile, by own time")
    args = p.parse_args(argv)
    if (args.sampling or args.profile) and not args.steps:
        p.error("--sampling and --profile apply to --steps only")
    if args.profile and args.variant:
        p.error("--profile prints one run's profile: run it without --variant")
    try:
        sampling_fields(args.sampling)
    except ValueError as error:
        p.error(f"--sampling takes numeric SamplingParams fields as KEY=VALUE,...: {error}")
    if args.variant:
        from bench import ab

        flags = ("--steps", "--sampling", args.sampling) if args.steps else ()
        ab.compare(args.variant, args.rounds, child_argv("offline", args, flags), args.out)
        return 0
    figures = measure_steps(args) if args.steps else measure(args)
    from bench.ab import format_figures

    print(format_figures(figures))
    if args.json_out:
        args.json_out.write_text(json.dumps(figures))
    return 0
