"""GPU check (issue 7, "On a GPU"): one script, under 8 minutes on an NVIDIA GPU, never in CI.

    .venv/bin/python bench/gpu_check.py --out gpu_check.md   # all three parts, needs CUDA
    .venv/bin/python bench/gpu_check.py --cpu-interpret      # part 1 only, tiny, CPU interpreter

1. The `triton` backend's KV store and paged attention against the `torch` backend on random
   paged steps (block sizes, GQA ratios, ragged lengths, one sequence over many blocks, decode
   and mixed prefill), in fp32/fp16/bf16: max abs error per case, PASS/FAIL. The store must be
   bit-exact; attention within a tolerance for the dtype.
2. Decode attention's achieved bandwidth: K/V bytes read per call / median time (CUDA events,
   after warm-up), against a device-to-device `copy_` of a large buffer.
3. Offline throughput at batch 64 (`LLM.generate`, same prompts, ignore_eos, fixed output
   length) with the triton backend and with the torch backend.

The figures go out as a Markdown section (--out, else stdout) for docs/benchmarks.md.
Exit status: 0 all checks passed, 1 a check failed, 2 no CUDA device (without --cpu-interpret).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch and triton are imported after TRITON_INTERPRET is decided
    from conveyor.engine.attention.random_step import RandomStep

TOLERANCE = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 2e-2}
"""Attention passes when |triton - torch| <= tol * (1 + |torch|) everywhere: a few units in
the last place of the dtype (both backends round their output; torch's SDPA also rounds the
probabilities to the dtype)."""
BANDWIDTH_SHAPES = [(1, 4096), (8, 4096), (32, 2048), (64, 1024), (64, 4096), (128, 2048)]
"""(batch, context length) of the decode bandwidth runs."""
BANDWIDTH_HEADS = (32, 8, 128)
"""Query heads, KV heads, head dim of the bandwidth runs (an 8B Llama's layer)."""
COPY_BYTES = 2 << 30
E2E_BATCH = 64


@dataclass(frozen=True, slots=True)
class Case:
    """One random paged step: seqs lists (num_cached, num_new) per request."""

    name: str
    block_size: int
    num_kv_heads: int
    group: int
    head_dim: int
    seqs: list[tuple[int, int]]


@dataclass(slots=True)
class CheckRow:
    case: str
    dtype: str
    store_error: float
    attention_error: float
    attention_within_tolerance: bool

    @property
    def passed(self) -> bool:
        return self.store_error == 0 and self.attention_within_tolerance


@dataclass(slots=True)
class BandwidthRow:
    batch: int
    context_len: int
    kv_bytes: int
    triton_ms: float
    torch_ms: float

    def gbps(self, ms: float) -> float:
        return self.kv_bytes / ms / 1e6


def tiny_cases() -> list[Case]:
    """Shapes small enough for the CPU interpreter (the kernel tests' sizes)."""
    return [
        Case("decode ragged, bs8, GQA 4", 8, 1, 4, 32, [(0, 1), (12, 1), (30, 1), (5, 1)]),
        Case("mixed prefill + decode, bs4, MHA", 4, 2, 1, 16, [(0, 5), (7, 1), (3, 1)]),
        Case("prefill chunks, bs16, GQA 3", 16, 2, 3, 16, [(0, 9), (20, 4), (1, 1)]),
        Case("one sequence over 23 blocks, bs2, GQA 2", 2, 1, 2, 8, [(45, 1), (0, 3)]),
    ]


def gpu_cases() -> list[Case]:
    rng = random.Random(0)
    ragged = [(rng.randint(1, 3000), 1) for _ in range(32)]
    return [
        Case("decode ragged x32, bs16, MHA", 16, 8, 1, 128, ragged),
        Case("decode ragged x32, bs32, GQA 4", 32, 2, 4, 128, ragged),
        Case("decode ragged x32, bs8, GQA 8, hd64", 8, 1, 8, 64, ragged),
        Case("one sequence over 1024 blocks, bs16, GQA 4", 16, 2, 4, 128, [(16383, 1)]),
        Case("mixed prefill + decode, bs16, GQA 3", 16, 3, 3, 64,
             [(0, 300), (700, 128), *ragged[:8]]),
        Case("mixed prefill chunks, bs64, GQA 2", 64, 4, 2, 128, [(0, 513), (2000, 37), (1, 1)]),
    ]


def random_step(case: Case, dtype, device: str, seed: int = 0) -> RandomStep:
    """The engine's random paged step (conveyor.engine.attention.random_step) for `case`,
    on `device`."""
    from conveyor.engine.attention.random_step import random_step as engine_random_step

    return engine_random_step(block_size=case.block_size, num_kv_heads=case.num_kv_heads,
                              group=case.group, head_dim=case.head_dim, seqs=case.seqs,
                              seed=seed, dtype=dtype).to(device)


def make_forward(name: str, step: RandomStep, kv_cache):
    """A zero-argument call of backend `name`'s forward on `step` (plan built once)."""
    from conveyor.engine.attention import create_backend

    backend = create_backend(name, step.spec)
    plan = backend.plan(step.meta)
    return lambda: backend.forward(step.query, step.key, step.value, kv_cache, plan)


def check_case(case: Case, dtype_name: str, device: str) -> CheckRow:
    import torch

    step = random_step(case, getattr(torch, dtype_name), device)
    caches = {name: step.kv_cache.clone() for name in ("torch", "triton")}
    outs = {name: make_forward(name, step, caches[name])() for name in caches}
    store_error = (caches["triton"].float() - caches["torch"].float()).abs().max().item()
    expected = outs["torch"].float()
    error = (outs["triton"].float() - expected).abs()
    within = bool((error <= TOLERANCE[dtype_name] * (1 + expected.abs())).all())
    return CheckRow(case.name, dtype_name, store_error, error.max().item(), within)


def run_checks(cases: list[Case], dtypes: list[str], device: str) -> list[CheckRow]:
    rows = []
    for dtype_name in dtypes:
        for case in cases:
            row = check_case(case, dtype_name, device)
            rows.append(row)
            print(f"  {'PASS' if row.passed else 'FAIL'} {dtype_name:8s} {case.name}: store "
                  f"{row.store_error:.3g}, attention {row.attention_error:.3g} "
                  f"(tol {TOLERANCE[dtype_name]:g})", flush=True)
    return rows


def median_ms(fn, warmup: int, iters: int) -> float:
    """Median of `iters` timings of fn() with CUDA events, after `warmup` calls."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_gbps(iters: int) -> float:
    """Device-to-device copy_ of COPY_BYTES, counted as bytes read + bytes written."""
    import torch

    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), warmup=3, iters=iters)
    return 2 * COPY_BYTES / ms / 1e6


def decode_bandwidth(batch: int, context_len: int, dtype, iters: int) -> BandwidthRow:
    num_heads, num_kv_heads, head_dim = BANDWIDTH_HEADS
    case = Case("bandwidth", 16, num_kv_heads, num_heads // num_kv_heads, head_dim,
                [(context_len - 1, 1)] * batch)
    step = random_step(case, dtype, "cuda")
    kv_bytes = batch * context_len * num_kv_heads * head_dim * 2 * step.kv_cache.element_size()
    ms = {name: median_ms(make_forward(name, step, step.kv_cache), warmup=3, iters=iters)
          for name in ("triton", "torch")}
    return BandwidthRow(batch, context_len, kv_bytes, ms["triton"], ms["torch"])


def run_bandwidth(dtype_name: str, iters: int) -> tuple[float, list[BandwidthRow]]:
    import torch

    copy = copy_gbps(iters)
    print(f"  device-to-device copy: {copy:.0f} GB/s (read + write)", flush=True)
    rows = []
    for batch, context_len in BANDWIDTH_SHAPES:
        row = decode_bandwidth(batch, context_len, getattr(torch, dtype_name), iters)
        rows.append(row)
        print(f"  batch {batch:3d} x {context_len:5d}: triton {row.gbps(row.triton_ms):6.0f} "
              f"GB/s ({row.gbps(row.triton_ms) / copy:.2f} of copy), torch "
              f"{row.gbps(row.torch_ms):6.0f} GB/s", flush=True)
        gc.collect()
        torch.cuda.empty_cache()
    return copy, rows


def offline_tokens_per_s(backend: str, args) -> float:
    """Output tokens/s of one LLM.generate call over E2E_BATCH prompts (after a warm-up)."""
    import torch

    from conveyor.engine import LLM, SamplingParams

    total_len = args.prompt_len + args.output_len
    llm = LLM(args.model, device="cuda", dtype=args.dtype, attention_backend=backend,
              max_num_seqs=E2E_BATCH, max_model_len=total_len,
              num_kv_blocks=2 * E2E_BATCH * (-(-total_len // 16)), enable_prefix_caching=False)
    rng = random.Random(0)
    vocab = llm.core.info.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(args.prompt_len)]}
               for _ in range(E2E_BATCH)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def run_e2e(args) -> dict[str, float]:
    result = {}
    for backend in ("triton", "torch"):
        result[backend] = offline_tokens_per_s(backend, args)
        print(f"  {backend}: {result[backend]:.0f} output tokens/s", flush=True)
    return result


def header(args, device_name: str) -> list[str]:
    import torch
    import triton

    return [f"## GPU check: {device_name}", "",
            f"`bench/gpu_check.py` on {datetime.date.today().isoformat()}: {device_name}, "
            f"torch {torch.__version__}, triton {triton.__version__}.", ""]


def checks_markdown(rows: list[CheckRow]) -> list[str]:
    tolerances = ", ".join(f"{name} {tol:g}" for name, tol in TOLERANCE.items())
    lines = ["### Triton kernels vs the torch backend", "",
             "Store: max abs difference of the pools (must be 0). Attention: max abs error of "
             f"the outputs; passes within tol x (1 + abs(torch)), tol {tolerances}.", "",
             "| case | dtype | store | attention | result |", "|---|---|---:|---:|---|"]
    lines += [f"| {r.case} | {r.dtype} | {r.store_error:.3g} | {r.attention_error:.3g} | "
              f"{'PASS' if r.passed else 'FAIL'} |" for r in rows]
    return lines + [""]


def bandwidth_markdown(copy: float, rows: list[BandwidthRow], dtype_name: str) -> list[str]:
    heads = "{} query heads, {} KV heads, head dim {}".format(*BANDWIDTH_HEADS)
    lines = ["### Decode attention bandwidth", "",
             f"One decode token per request, {heads}, block size 16, {dtype_name}; K/V bytes "
             f"read per call / median time of one backend forward (store included). "
             f"Device-to-device `copy_` of {COPY_BYTES >> 30} GiB: {copy:.0f} GB/s "
             "(read + write).", "",
             "| batch | context | K/V MiB | triton GB/s | of copy | torch GB/s | of copy |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        triton_gbps, torch_gbps = r.gbps(r.triton_ms), r.gbps(r.torch_ms)
        lines.append(f"| {r.batch} | {r.context_len} | {r.kv_bytes >> 20} | {triton_gbps:.0f} "
                     f"| {triton_gbps / copy:.2f} | {torch_gbps:.0f} | {torch_gbps / copy:.2f} |")
    return lines + [""]


def e2e_markdown(result: dict[str, float], args) -> list[str]:
    return ["### Offline throughput, triton vs torch backend", "",
            f"`LLM.generate`, {args.model}, {args.dtype}, batch {E2E_BATCH}, random "
            f"{args.prompt_len}-token prompts, {args.output_len} output tokens (ignore_eos, "
            "greedy), prefix caching off.", "",
            "| triton (output tok/s) | torch (output tok/s) | ratio |", "|---:|---:|---:|",
            f"| {result['triton']:.0f} | {result['torch']:.0f} | "
            f"{result['triton'] / result['torch']:.2f}x |", ""]


def parse_args(argv: list[str]):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the Markdown section here (default: "
                        "stdout)")
    parser.add_argument("--cpu-interpret", action="store_true", help="part 1 only, tiny "
                        "shapes, on the CPU under TRITON_INTERPRET=1 (no GPU needed)")
    parser.add_argument("--parts", default="1,2,3", help="which parts to run, e.g. 1,3")
    parser.add_argument("--dtype", default="bfloat16", choices=list(TOLERANCE),
                        help="dtype of parts 2 and 3")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--iters", type=int, default=20, help="timed calls per figure")
    return parser.parse_args(argv)


def run(args) -> tuple[list[str], bool]:
    """Run the selected parts; returns the report's lines and whether every check passed."""
    import torch

    parts = set(args.parts.split(","))
    device_name = ("no GPU (CPU, TRITON_INTERPRET=1, tiny shapes, part 1 only)"
                   if args.cpu_interpret else torch.cuda.get_device_name())
    lines, passed = header(args, device_name), True
    if "1" in parts:
        print("part 1: triton kernels vs torch backend", flush=True)
        cases, dtypes = ((tiny_cases(), ["float32", "bfloat16"]) if args.cpu_interpret
                         else (gpu_cases(), list(TOLERANCE)))
        rows = run_checks(cases, dtypes, "cpu" if args.cpu_interpret else "cuda")
        passed = all(r.passed for r in rows)
        lines += checks_markdown(rows)
    if "2" in parts and not args.cpu_interpret:
        print("part 2: decode attention bandwidth", flush=True)
        lines += bandwidth_markdown(*run_bandwidth(args.dtype, args.iters), args.dtype)
    if "3" in parts and not args.cpu_interpret:
        print(f"part 3: offline throughput at batch {E2E_BATCH}", flush=True)
        lines += e2e_markdown(run_e2e(args), args)
    return lines, passed


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.cpu_interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # read by triton.jit when the kernels import
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    import torch

    if not args.cpu_interpret and not torch.cuda.is_available():
        print("gpu_check: no CUDA device found. This script measures the Triton kernels on an "
              "NVIDIA GPU; run it there, or pass --cpu-interpret to run only the correctness "
              "checks (part 1) with tiny shapes on the CPU.", file=sys.stderr)
        return 2
    start = time.perf_counter()
    lines, passed = run(args)
    text = "\n".join(lines)
    if args.out:
        args.out.write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text)
    print(f"gpu_check: {'all checks passed' if passed else 'a check FAILED'} "
          f"({time.perf_counter() - start:.0f} s)")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
