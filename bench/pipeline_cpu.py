"""CPU per output token of each process of the served pipeline, old code against new.

Starts the pipeline (tokenizer, engine, detok, gateway as processes, as `make run` does)
from each `--repo` in turn, round after round (A B, B A, A B, ...), and at each concurrency
sends `--num-requests` streaming completions (256-token random prompts, 64 output tokens,
ignore_eos) after a warm-up. Around each measured run it reads every service's CPU
seconds (utime + stime of the process and its live descendants, /proc/<pid>/stat), this
process's (the load generator, "client"), the machine's busy seconds ("others": what
nobody named spent; a run where they exceed 0.15 cores is marked DISTURBED and left out of
the means), and the voluntary context switches of every thread of each process
("wakeups": each one, on a machine whose cores the engine's threads fill, is a stall of a
step). It prints CPU ms and wakeups per output token of each, TPOT p50 and output tok/s,
then the mean of each repo over the rounds and each repo's ratio to the first.

With `--in-process`, each repo's served runs are followed, back to back, by the offline
engine of its engine checkout (a child process with the engine's environment and threads)
on the same c1 prompts: "served/in-process" is the served c1 TPOT over the engine's own,
what the pipeline adds to a token (issue 31's target: at most 1.10x with q4_1_int8).

A repo is a checkout (e.g. a git worktree of the base commit) with its protos generated
(scripts/gen_protos.py); its services run from it through PYTHONPATH on this .venv.
`--engine-repo` runs every engine from one checkout, so that only the other services'
code differs between the repos. `--service-env NAME=KEY=VALUE`, `--engine-env
[NAME:]KEY=VALUE` and `--pythonpath NAME=DIR` try a setting or a package on one side only.

    git worktree add --detach /tmp/base <base commit>
    .venv/bin/python /tmp/base/scripts/gen_protos.py
    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.pipeline_cpu --repo old=/tmp/base --repo new=. \
        --engine-repo /tmp/base --rounds 2 --concurrency 1,16 \
        --engine-env CONVEYOR_ENGINE_WEIGHT_FORMAT=q4_1_int8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

SERVICES = ("engine", "gateway", "detok", "tokenizer", "client", "others")
PROMPT_LEN, OUTPUT_LEN = 256, 64
DISTURBED_CORES = 0.15
"""Other processes' CPU over a run, in cores, past which the run is marked disturbed and left
out of the means (as the peer suite does: bench/suite/scenarios.py); quiet runs read ~0.02."""
ENGINE_ENV = {"CONVEYOR_ENGINE_KV_CACHE_GIB": "4", "CONVEYOR_ENGINE_MAX_NUM_WAITING_TOKENS": "0"}
"""The engine as the peer suite runs it (bench/suite/peer_comparison.py: CONVEYOR_ENV)."""


@dataclass(frozen=True, slots=True)
class Repo:
    name: str
    path: Path

    @classmethod
    def parse(cls, spec: str) -> Repo:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise argparse.ArgumentTypeError(f"--repo {spec!r}: expected NAME=PATH")
        return cls(name, Path(path).resolve())


def repo_pythonpath(repo: Path) -> str:
    """The package folders of a checkout (common and each service), for PYTHONPATH: they
    come before the .venv's editable installs, so the checkout's code is what runs."""
    folders = [repo / "common", *sorted((repo / "services").iterdir())]
    return os.pathsep.join(str(f) for f in folders if (f / "conveyor").is_dir())


def ms_per_token(cpu_s: dict[str, float], num_tokens: int) -> dict[str, float]:
    """CPU milliseconds per output token of each process (0 when nothing came out)."""
    return {name: 1e3 * s / num_tokens if num_tokens else 0.0 for name, s in cpu_s.items()}


def with_others(cpu_s: dict[str, float], machine_busy_s: float) -> dict[str, float]:
    """`cpu_s` plus "others": the machine's busy seconds nobody in `cpu_s` spent."""
    return {**cpu_s, "others": max(0.0, machine_busy_s - sum(cpu_s.values()))}


def parse_switches(status_text: str) -> int:
    """Voluntary context switches from the text of /proc/<pid>/task/<tid>/status: how many
    times the thread went to sleep and was woken again."""
    for line in status_text.splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            return int(line.split()[1])
    return 0


def wakeups(pid: int, proc: Path = Path("/proc")) -> int:
    """Voluntary context switches of all the threads of `pid` so far (0 once it is gone)."""
    total = 0
    for task in (proc / str(pid) / "task").glob("*"):
        try:
            total += parse_switches((task / "status").read_text())
        except OSError:
            continue  # the thread ended while being read
    return total


def round_order(repos: list[Repo], round_index: int) -> list[Repo]:
    """The repos in their order in even rounds, reversed in odd ones (A B, B A, A B, ...), so
    that a machine that drifts during a round does not favour the repo that always runs first
    (identical code read 1.16x apart at c16 in a run that always started with the base)."""
    return list(repos) if round_index % 2 == 0 else list(reversed(repos))


def summarize(rows: list[dict]) -> list[dict]:
    """The mean of each (repo, concurrency) over its rounds, in first-seen order; disturbed
    rounds are left out while the group has an undisturbed one."""
    groups: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for row in rows:
        groups[row["repo"], row["concurrency"]].append(row)
    out = []
    for (repo, concurrency), group in groups.items():
        group = [r for r in group if not is_disturbed(r)] or group
        cpu = {name: statistics.fmean(r["cpu_ms_per_token"][name] for r in group)
               for name in group[0]["cpu_ms_per_token"]}
        woken = {name: statistics.fmean(r["wakeups_per_token"][name] for r in group)
                 for name in group[0]["wakeups_per_token"]}
        out.append({"repo": repo, "concurrency": concurrency, "rounds": len(group),
                    "cpu_ms_per_token": cpu, "wakeups_per_token": woken,
                    "tpot_p50_ms": statistics.fmean(r["tpot_p50_ms"] for r in group),
                    "output_tok_s": statistics.fmean(r["output_tok_s"] for r in group)})
    return out


def format_in_process(summary: list[dict], in_process: list[dict]) -> list[str]:
    """Each repo's served c1 TPOT over its engine's in-process TPOT (means over rounds)."""
    lines = []
    for row in summary:
        own = [r["tpot_p50_ms"] for r in in_process if r["repo"] == row["repo"]]
        if row["concurrency"] == 1 and own:
            alone = statistics.fmean(own)
            lines.append(f"{row['repo']} c1: served {row['tpot_p50_ms']:.2f} ms / in-process "
                         f"{alone:.2f} ms = {row['tpot_p50_ms'] / alone:.3f}x "
                         f"(in-process rounds {', '.join(f'{t:.2f}' for t in own)})")
    return lines


def is_disturbed(row: dict) -> bool:
    return row["cpu_s"]["others"] / max(row["duration_s"], 1e-9) > DISTURBED_CORES


def format_row(row: dict) -> str:
    cpu = row["cpu_ms_per_token"]
    services = " ".join(f"{name} {cpu[name]:.3f}" for name in SERVICES if name in cpu)
    woken = " ".join(f"{name} {n:.1f}" for name, n in row["wakeups_per_token"].items())
    return (f"{row['repo']:>8} c{row['concurrency']:<3} {row['output_tok_s']:7.1f} tok/s  "
            f"TPOT p50 {row['tpot_p50_ms']:6.2f} ms  CPU ms/token: {services}  "
            f"wakeups/token: {woken}" + ("  DISTURBED" if "cpu_s" in row and is_disturbed(row)
                                         else ""))


def format_ratios(summary: list[dict]) -> list[str]:
    """Each repo's figures over the first repo's at the same concurrency."""
    first: dict[int, dict] = {}
    lines = []
    for row in summary:
        base = first.setdefault(row["concurrency"], row)
        if base is row:
            continue
        cpu, base_cpu = row["cpu_ms_per_token"], base["cpu_ms_per_token"]
        ratios = " ".join(f"{name} {cpu[name] / base_cpu[name]:.2f}x" for name in SERVICES
                          if base_cpu.get(name))
        lines.append(f"{row['repo']}/{base['repo']} c{row['concurrency']}: TPOT p50 "
                     f"{row['tpot_p50_ms'] / base['tpot_p50_ms']:.3f}x, tok/s "
                     f"{row['output_tok_s'] / base['output_tok_s']:.3f}x; CPU per token {ratios}")
    return lines


# -- running (needs the pipeline's code; imported here so the figures above test alone) --

def measure(target, requests, concurrency: int) -> dict:
    """One measured run against a started pipeline: its figures and CPU per token."""
    from bench.suite import cpu_time

    pids = {**target.pids, "client": os.getpid()}
    target.run(requests[:1], 1, num_warmup=0)
    woken_before = {name: wakeups(pid) for name, pid in pids.items()}
    before, busy_before = cpu_time.snapshot(target.pids), cpu_time.machine_busy_s()
    metrics, _ = target.run(requests[1:], concurrency, num_warmup=0)
    cpu = cpu_time.spent(before, cpu_time.snapshot(target.pids))
    woken = {name: wakeups(pid) - woken_before[name] for name, pid in pids.items()}
    cpu = with_others(cpu, cpu_time.machine_busy_s() - busy_before)
    if metrics.failed:
        print(f"  {metrics.failed} requests failed: {metrics.errors[:2]}")
    return {"concurrency": concurrency, "completed": metrics.completed,
            "duration_s": metrics.duration_s,
            "output_tokens": metrics.total_output_tokens,
            "output_tok_s": metrics.output_throughput, "tpot_p50_ms": metrics.tpot.p50,
            "cpu_s": cpu, "cpu_ms_per_token": ms_per_token(cpu, metrics.total_output_tokens),
            "wakeups_per_token": {name: n / max(metrics.total_output_tokens, 1)
                                  for name, n in woken.items()}}


def run_repo(repo: Repo, args, maker, log_dir: Path) -> list[dict]:
    """Start the pipeline from `repo`, warm it, measure each concurrency, stop it."""
    extra = [d for name, d in args.pythonpath if name == repo.name]
    service_env = {"PYTHONPATH": os.pathsep.join([repo_pythonpath(repo.path), *extra]),
                   **{k: v for name, k, v in args.service_env if name == repo.name}}
    engine_repo = args.engine_repo or repo.path
    engine_env = {**ENGINE_ENV, "CONVEYOR_ENGINE_TORCH_THREADS": str(args.threads),
                  **{k: os.environ.get(k, "") for k in service_env},  # as the engine had them
                  "PYTHONPATH": repo_pythonpath(engine_repo),
                  **{k: v for name, k, v in args.engine_env if name in ("", repo.name)}}
    saved = dict(os.environ)
    os.environ.update(service_env)  # what the services but the engine start with
    try:
        return _measure_pipeline(repo, args, maker, log_dir, engine_env)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _measure_pipeline(repo: Repo, args, maker, log_dir: Path, engine_env: dict) -> list[dict]:
    rows = _measure_served(repo, args, maker, log_dir, engine_env)
    if args.in_process:
        maker.rng.seed(args.concurrency.index(1) if 1 in args.concurrency else 0)
        requests = maker.random_requests(args.num_requests + 1, PROMPT_LEN, args.output_len)
        row = {"repo": repo.name, "concurrency": 1, "in_process": True,
               **in_process_tpot(requests, args.output_len, engine_env)}
        print(f"{repo.name:>8} in-process c1: TPOT p50 {row['tpot_p50_ms']:6.2f} ms", flush=True)
        rows.append(row)
    return rows


def in_process_tpot(requests, output_len: int, engine_env: dict) -> dict:
    """The offline engine (run as `main` runs with --in-process-child, in a child with the
    engine's environment) on `requests` one at a time: the first warms up, the others'
    TPOT p50 as the served runs count it."""
    import subprocess
    import sys

    spec = {"prompts": [r.prompt for r in requests], "output_len": output_len}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    env = {**os.environ, **engine_env}
    out = subprocess.run([sys.executable, __file__, "--in-process-child", f.name], env=env,
                         check=True, capture_output=True, text=True).stdout
    os.unlink(f.name)
    return json.loads(out.splitlines()[-1])


def _in_process_child(spec_path: str) -> None:
    """Run by path, so that `conveyor.engine` is the engine checkout's on PYTHONPATH."""
    import time

    from conveyor.engine import LLM
    from conveyor.engine.engine_request import EngineRequest
    from conveyor.engine.sampling_params import SamplingParams

    spec = json.loads(Path(spec_path).read_text())
    llm = LLM()
    tpots = []
    for i, prompt in enumerate(spec["prompts"]):
        ids = llm.get_tokenizer()(prompt, add_special_tokens=False)["input_ids"]
        params = SamplingParams(temperature=0.0, max_tokens=spec["output_len"], ignore_eos=True)
        llm.core.add_request(EngineRequest(f"r{i}", ids, params))
        times = []
        while llm.core.has_unfinished_requests:
            result = llm.core.step()
            now = time.perf_counter()
            deltas = getattr(result, "deltas", result)  # a StepResult before issue 31 step 2
            times += [now for delta in deltas for _ in delta.new_token_ids]
        if i:  # the first warms up
            tpots.append((times[-1] - times[0]) / (len(times) - 1))
    print(json.dumps({"tpot_p50_ms": statistics.median(tpots) * 1000}))


def _measure_served(repo: Repo, args, maker, log_dir: Path, engine_env: dict) -> list[dict]:
    from bench.suite.targets import conveyor_pipeline

    rows = []
    with conveyor_pipeline(log_dir / repo.name, engine_env, name=repo.name) as target:
        burst = maker.random_requests(16, PROMPT_LEN, 4)  # threads up, kernels chosen
        target.run(burst, 16, num_warmup=0)
        for seed, concurrency in enumerate(args.concurrency):
            maker.rng.seed(seed)  # the same prompts for every repo and round
            requests = maker.random_requests(args.num_requests + 1, PROMPT_LEN, args.output_len)
            row = {"repo": repo.name, **measure(target, requests, concurrency)}
            print(format_row(row), flush=True)
            rows.append(row)
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", type=Repo.parse, action="append", required=True,
                   help="NAME=PATH of a checkout to run (repeat for A/B; the first is the base)")
    p.add_argument("--engine-repo", type=lambda s: Path(s).resolve(), default=None,
                   help="run every engine from this checkout (default: each repo's own)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", type=lambda s: [int(c) for c in s.split(",")],
                   default=[1, 16])
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--output-len", type=int, default=OUTPUT_LEN,
                   help="output tokens a request (ignore_eos); a run at another length splits "
                   "a service's CPU into per-request and per-token parts")
    p.add_argument("--threads", type=int, default=2, help="the engine's torch threads")
    p.add_argument("--engine-env", action="append", default=[], type=_engine_entry,
                   help="[NAME:]KEY=VALUE for the engine (e.g. "
                   "CONVEYOR_ENGINE_WEIGHT_FORMAT=q4_1_int8); with NAME: repo NAME's only")
    p.add_argument("--pythonpath", action="append", default=[], type=lambda s: s.split("=", 1),
                   help="NAME=DIR: put DIR after repo NAME's folders on its services' PYTHONPATH "
                   "(e.g. packages installed with pip --target, to try them on one side)")
    p.add_argument("--service-env", action="append", default=[], type=lambda s: s.split("=", 2),
                   help="NAME=KEY=VALUE: an environment entry of repo NAME's services but the "
                   "engine (the engine keeps what this process has)")
    p.add_argument("--in-process", action="store_true",
                   help="after each repo's served runs, its engine in process on the c1 prompts")
    p.add_argument("--out", type=Path, default=None, help="write every row and the summary as JSON")
    return p.parse_args(argv)


def _engine_entry(spec: str) -> tuple[str, str, str]:
    """(repo name or "" for every repo, key, value) of an --engine-env entry."""
    key, _, value = spec.partition("=")
    name, _, key = key.rpartition(":")
    return name, key, value


def main(argv=None) -> None:
    from bench.serving.workload import load_prompt_maker

    args = parse_args(argv)
    maker = load_prompt_maker()
    log_dir = Path(tempfile.mkdtemp(prefix="pipeline-cpu-"))
    print(f"service logs in {log_dir}")
    rows = []
    for round_index in range(args.rounds):
        for repo in round_order(args.repo, round_index):
            rows += run_repo(repo, args, maker, log_dir)
    in_process = [r for r in rows if r.get("in_process")]
    summary = summarize([r for r in rows if not r.get("in_process")])
    print("\nmean over rounds:")
    for row in summary:
        print(format_row(row))
    for line in format_ratios(summary) + format_in_process(summary, in_process):
        print(line)
    if args.out:
        args.out.write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--in-process-child"]:
        _in_process_child(sys.argv[2])
    else:
        main()
