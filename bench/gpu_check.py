"""GPU check (issue 20): one self-contained run, under 4 minutes on an NVIDIA GPU, never in CI.

    python3 bench/gpu_check.py --out docs/img/gpu_check.md   # all parts, needs CUDA
    python3 bench/gpu_check.py --cpu-interpret               # parts 1 and 3, tiny, CPU

Self-contained: it needs a Python with torch, triton, numpy and safetensors, and this
repository's `common/` and `services/engine/` sources (put on sys.path here): no
installed project, no model files (random weights of named Llama shapes), no
services, no network.

1. Triton vs torch: the `triton` backend's KV store and tiled attention against the
   `torch` backend on random paged steps (decode, mixed prefill chunks, prefix hits), in
   fp32/fp16/bf16 (bench/gpu_kernel_checks.py).
2. Decode attention bandwidth at batch 64, contexts 1,024 and 4,096, against a measured
   device-to-device copy; target 70% of the copy (bench/gpu_bandwidth.py).
3. Offline decode-step throughput at batch 1, 16, 64 and 256, CUDA graphs on and off, on
   SmolLM2-135M's and Llama-3.2-1B's shapes (bench/gpu_step_throughput.py).
4. Memory sizing at start: profiled pool within memory_utilization, refusal naming the
   setting (bench/gpu_memory_sizing.py).

The figures go out as a dated Markdown section naming the GPU (--out, else stdout), which
`bench/run_suite.py --report-only` puts into docs/benchmarks.md. Under --cpu-interpret,
part 1 runs tiny shapes under TRITON_INTERPRET=1 and part 3 the tiny model for a couple of
steps (the code path only; its figures mean nothing). Exit status: 0 every check passed,
1 a check failed, 2 no CUDA device (without --cpu-interpret).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "common", ROOT / "services" / "engine"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

DTYPES = ("float32", "float16", "bfloat16")


def header(device_name: str) -> list[str]:
    import torch
    import triton

    return [f"## GPU check: {device_name}", "",
            f"`bench/gpu_check.py` on {datetime.date.today().isoformat()}: {device_name}, "
            f"torch {torch.__version__}, triton {triton.__version__}.", ""]


def part_kernels(args) -> tuple[list[str], bool]:
    from bench import gpu_kernel_checks as k

    print("part 1: triton kernels vs torch backend", flush=True)
    cases, dtypes = ((k.tiny_cases(), ["float32", "bfloat16"]) if args.cpu_interpret
                     else (k.gpu_cases(), list(DTYPES)))
    rows = k.run_checks(cases, dtypes, "cpu" if args.cpu_interpret else "cuda")
    return k.checks_markdown(rows), all(r.passed for r in rows)


def part_bandwidth(args) -> tuple[list[str], bool]:
    from bench import gpu_bandwidth as b

    print("part 2: decode attention bandwidth", flush=True)
    copy, rows = b.run_bandwidth(args.dtype, args.iters)
    return b.bandwidth_markdown(copy, rows, args.dtype), b.passed(copy, rows)


def part_throughput(args) -> tuple[list[str], bool]:
    from bench import gpu_step_throughput as t

    plan = (t.Plan.on_cpu_interpreter() if args.cpu_interpret
            else t.Plan.on_gpu(args.dtype, args.iters))
    print(f"part 3: decode-step throughput at batch {', '.join(map(str, plan.batches))}, "
          "CUDA graphs on and off", flush=True)
    cosines, rows = t.run_throughput(plan)
    return t.throughput_markdown(cosines, rows, plan), t.passed(cosines)


def part_sizing(args) -> tuple[list[str], bool]:
    from bench import gpu_memory_sizing as m

    print("part 4: memory sizing at start", flush=True)
    result = m.run_sizing(args.dtype)
    return m.sizing_markdown(result), result.passed


PARTS = {"1": part_kernels, "2": part_bandwidth, "3": part_throughput, "4": part_sizing}
CPU_PARTS = {"1", "3"}
"""Parts that run under --cpu-interpret (2 and 4 time or size a real device)."""


def parse_args(argv: list[str]):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the Markdown section here (default: "
                        "stdout)")
    parser.add_argument("--cpu-interpret", action="store_true", help="parts 1 and 3 only, "
                        "tiny shapes, on the CPU under TRITON_INTERPRET=1 (no GPU needed)")
    parser.add_argument("--parts", default="4,1,2,3",
                        help="which parts to run, in order, e.g. 1,3 (sizing first by default: "
                        "it measures a fresh process, as an engine starts)")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES,
                        help="dtype of parts 2-4")
    parser.add_argument("--iters", type=int, default=20, help="timed calls or steps per "
                        "figure")
    return parser.parse_args(argv)


def run(args) -> tuple[list[str], bool]:
    """Run the selected parts; returns the report's lines and whether every check passed."""
    import torch

    parts = [p for p in args.parts.split(",") if p in PARTS]
    if args.cpu_interpret:
        parts = [p for p in parts if p in CPU_PARTS]
    device_name = ("no GPU (CPU, TRITON_INTERPRET=1, tiny shapes: code paths only)"
                   if args.cpu_interpret else torch.cuda.get_device_name())
    lines, passed = header(device_name), True
    for part in parts:
        start = time.perf_counter()
        part_lines, part_passed = PARTS[part](args)
        print(f"  (part {part}: {time.perf_counter() - start:.0f} s)", flush=True)
        lines += part_lines
        passed = passed and part_passed
    return lines, passed


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.cpu_interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # read by triton.jit when the kernels import
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    logging.basicConfig(level=logging.INFO, format="  %(name)s: %(message)s")
    import torch

    if not args.cpu_interpret and not torch.cuda.is_available():
        print("gpu_check: no CUDA device found. This script measures the Triton kernels on an "
              "NVIDIA GPU; run it there, or pass --cpu-interpret to run the correctness "
              "checks and the runner's code path with tiny shapes on the CPU.", file=sys.stderr)
        return 2
    start = time.perf_counter()
    lines, passed = run(args)
    text = "\n".join(lines)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text)
    print(f"gpu_check: {'all checks passed' if passed else 'a check FAILED'} "
          f"({time.perf_counter() - start:.0f} s)")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
