"""What the kernel benchmarks share: the timing loop (callables taking turns), the median and
spread of its rounds, a comparison against the first callable, the machine line, the Markdown
table."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Timing:
    """Seconds per call over rounds: their median and spread ((max - min) / median)."""

    median: float
    spread: float

    @classmethod
    def of(cls, seconds: list[float]) -> Timing:
        median = statistics.median(seconds)
        return cls(median, (max(seconds) - min(seconds)) / median)

    @property
    def ms(self) -> float:
        return self.median * 1e3

    @property
    def spread_pct(self) -> str:
        return f"{self.spread:.0%}"


def time_rounds(fns: dict[str, Callable[[], object]], rounds: int,
                reps: int = 1) -> dict[str, Timing]:
    """Each callable's seconds per call over `rounds` rounds in which they take turns (so a
    change in the machine's load hits them alike); a turn is one untimed call, then `reps`."""
    seconds: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            fn()
            start = time.perf_counter()
            for _ in range(reps):
                fn()
            seconds[name].append((time.perf_counter() - start) / reps)
    return {name: Timing.of(times) for name, times in seconds.items()}


def compare(fns: dict[str, Callable[[], torch.Tensor]], rounds: int,
            reps: int = 1) -> list[dict]:
    """A table row per callable: ms, spread, speed-up over the first and the largest absolute
    difference of its output from the first's (in fp32)."""
    first = next(iter(fns))
    reference = fns[first]().float().clone()
    diffs = {name: (fn().float() - reference).abs().max().item() for name, fn in fns.items()}
    timings = time_rounds(fns, rounds, reps)
    base = timings[first].median
    return [{"variant": name, "ms": t.ms, "±": t.spread_pct,
             f"vs {first}": f"{base / t.median:.2f}x", "max abs diff": diffs[name]}
            for name, t in timings.items()]


def machine_line() -> str:
    return (f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), CPU capability "
            f"{torch.backends.cpu.get_cpu_capability()}, load average "
            + " ".join(f"{load:.2f}" for load in os.getloadavg()))


def _cell(value: object) -> str:
    if not isinstance(value, float):
        return str(value)
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.3g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.1e}"


def markdown_table(rows: list[dict]) -> str:
    """The rows (dicts with the same keys, the header) as a Markdown table; floats to 3
    significant digits (whole numbers from 100, powers of ten below 0.001)."""
    lines = [list(rows[0]), ["---"] * len(rows[0]), *([_cell(v) for v in r.values()] for r in rows)]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)
