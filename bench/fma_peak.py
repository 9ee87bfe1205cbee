"""The CPU's fp32 FMA peak, measured with every thread running at once (bench/csrc/fma_peak.cpp).

A yardstick for the model-FLOP/s target that no kernel can exceed: on a VM whose vCPUs share a
core's FMA units at times (the sixth round's Zen 4 VM: two vCPUs with one core's arithmetic
between them in some minutes, two cores' in others) the peak of two threads at once can be one
core's, which a per-core figure times the thread count would overstate.
It prints the rate of one thread alone and of all threads together, in AVX2 (8 lanes) and, where
the CPU has it, AVX-512 (16 lanes).

    .venv/bin/python -m bench.fma_peak [--threads 2]
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

SOURCE = Path(__file__).resolve().parent / "csrc" / "fma_peak.cpp"


@functools.cache
def _kernel():
    from conveyor.engine.native import CPU_CFLAGS, load_extension

    return load_extension("conveyor_bench_fma_peak", [SOURCE], CPU_CFLAGS)


def lanes_available() -> list[int]:
    return [8, 16] if torch.backends.cpu.get_cpu_capability() == "AVX512" else [8]


def fma_gflops(threads: int, lanes: int, seconds: float = 0.25) -> float:
    """Best fp32 GFLOP/s of `threads` threads running FMA chains at once (3 timed runs of
    about `seconds` each, sized by a short first run)."""
    kernel = _kernel()
    previous = torch.get_num_threads()
    torch.set_num_threads(max(previous, threads))
    try:
        elapsed, _ = kernel.fma_loop(100_000, threads, lanes)
        iterations = max(1000, int(100_000 * seconds / max(elapsed, 1e-6)))
        best = 0.0
        for _ in range(3):
            elapsed, flops = kernel.fma_loop(iterations, threads, lanes)
            best = max(best, flops / elapsed / 1e9)
        return best
    finally:
        torch.set_num_threads(previous)


def fma_peak_gflops(threads: int) -> float:
    """The widest vector's peak with `threads` threads at once."""
    return max(fma_gflops(threads, lanes) for lanes in lanes_available())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    for lanes in lanes_available():
        alone = fma_gflops(1, lanes)
        together = fma_gflops(args.threads, lanes)
        print(f"{lanes} lanes: one thread {alone:.1f} GFLOP/s; {args.threads} threads at once "
              f"{together:.1f} GFLOP/s = {together / alone:.2f}x one thread")
    return 0


if __name__ == "__main__":
    sys.exit(main())
