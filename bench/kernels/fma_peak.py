"""The CPU's fp32 FMA peak with every thread running at once (fma_peak.cpp beside this file).

The ceiling no kernel passes, per vector width (AVX2's 8 lanes; AVX-512's 16 where the CPU has
it): one thread alone and --threads together. On a VM whose vCPUs share a core's FMA units at
times (the sixth round's Zen 4) two threads at once can reach only one core's rate, which a
per-core figure times the thread count would overstate.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import torch

from bench.kernels.harness import markdown_table

SOURCE = Path(__file__).resolve().with_suffix(".cpp")


@functools.cache
def kernel():
    from conveyor.engine.native import CPU_CFLAGS, load_extension

    return load_extension("conveyor_bench_fma_peak", [SOURCE], CPU_CFLAGS)


def lanes_available() -> list[int]:
    return [8, 16] if torch.backends.cpu.get_cpu_capability() == "AVX512" else [8]


def fma_gflops(threads: int, lanes: int, seconds: float = 0.25) -> float:
    """Best fp32 GFLOP/s of `threads` threads running FMA chains at once (3 timed runs of
    about `seconds` each, sized by a short first run)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(max(previous, threads))
    try:
        elapsed, _ = kernel().fma_loop(100_000, threads, lanes)
        iterations = max(1000, int(100_000 * seconds / max(elapsed, 1e-6)))
        return max(flops / elapsed / 1e9 for elapsed, flops in
                   (kernel().fma_loop(iterations, threads, lanes) for _ in range(3)))
    finally:
        torch.set_num_threads(previous)


def fma_peak_gflops(threads: int) -> float:
    """The widest vector's peak with `threads` threads at once."""
    return max(fma_gflops(threads, lanes) for lanes in lanes_available())


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Only --threads (the threads that run at once)."""


def run(args: argparse.Namespace) -> None:
    table = []
    for lanes in lanes_available():
        alone, together = fma_gflops(1, lanes), fma_gflops(args.threads, lanes)
        table.append({"lanes": lanes, "1 thread GFLOP/s": alone,
                      f"{args.threads} threads at once GFLOP/s": together,
                      "x one thread": f"{together / alone:.2f}x"})
    print(markdown_table(table))
