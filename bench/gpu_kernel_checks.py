"""gpu_check part 1: the `triton` backend's KV store and attention against `torch`.

Random paged steps (devkit.random_step): ragged decode, one sequence
over many blocks, and mixed steps (first prefill chunks longer than one query tile,
chunks after a prefix hit, decode rows), in each dtype. The store must be bit-exact;
attention within a tolerance for the dtype.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch and triton are imported after TRITON_INTERPRET is decided
    from devkit.random_step import RandomStep

TOLERANCE = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 2e-2}
"""Attention passes when |triton - torch| <= tol * (1 + |torch|) everywhere: a few units in
the last place of the dtype (both backends round their output; torch's SDPA and the
kernel's 16-bit dot round the probabilities to the dtype)."""


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


def tiny_cases() -> list[Case]:
    """Shapes small enough for the CPU interpreter (the kernel tests' sizes)."""
    return [
        Case("decode ragged, bs8, GQA 4", 8, 1, 4, 32, [(0, 1), (12, 1), (30, 1), (5, 1)]),
        Case("mixed prefill + decode, bs4, MHA", 4, 2, 1, 16, [(0, 5), (7, 1), (3, 1)]),
        Case("prefill chunks, bs16, GQA 3", 16, 2, 3, 16, [(0, 9), (20, 4), (1, 1)]),
        Case("one sequence over 23 blocks, bs2, GQA 2", 2, 1, 2, 8, [(45, 1), (0, 3)]),
        Case("chunk over two tiles + prefix hit + decodes, bs16, MHA", 16, 1, 1, 16,
             [(0, 70), (32, 9), (50, 1)]),
    ]


def gpu_cases() -> list[Case]:
    rng = random.Random(0)
    ragged = [(rng.randint(1, 3000), 1) for _ in range(32)]
    return [
        Case("decode ragged x32, bs16, GQA 4", 16, 8, 4, 128, ragged),
        Case("decode ragged x32, bs32, GQA 8, hd64", 32, 1, 8, 64, ragged),
        Case("one sequence over 1024 blocks, bs16, GQA 4", 16, 2, 4, 128, [(16383, 1)]),
        Case("mixed: prefill 300 + prefix hit + chunks + 8 decodes, bs16, GQA 3", 16, 3, 3,
             64, [(0, 300), (512, 128), (700, 77), *ragged[:8]]),
        Case("mixed prefill chunks, bs64, GQA 2", 64, 4, 2, 128, [(0, 513), (2000, 37), (1, 1)]),
    ]


def random_step(case: Case, dtype, device: str, seed: int = 0) -> RandomStep:
    """The engine's random paged step for `case`, on `device`."""
    from devkit.random_step import random_step as engine_random_step

    return engine_random_step(block_size=case.block_size, num_kv_heads=case.num_kv_heads,
                              group=case.group, head_dim=case.head_dim, seqs=case.seqs,
                              seed=seed, dtype=dtype).to(device)


def make_forward(name: str, step: RandomStep, kv_cache, plan_edit=None):
    """A zero-argument call of backend `name`'s forward on `step` (plan built once,
    then passed through plan_edit if given)."""
    from conveyor.engine.attention import create_backend

    backend = create_backend(name, step.spec)
    plan = backend.plan(step.meta)
    if plan_edit is not None:
        plan = plan_edit(plan)
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


def checks_markdown(rows: list[CheckRow]) -> list[str]:
    tolerances = ", ".join(f"{name} {tol:g}" for name, tol in TOLERANCE.items())
    lines = ["### Triton kernels vs the torch backend", "",
             "Store: max abs difference of the pools (must be 0). Attention: max abs error of "
             f"the outputs; passes within tol x (1 + abs(torch)), tol {tolerances}.", "",
             "| case | dtype | store | attention | result |", "|---|---|---:|---:|---|"]
    lines += [f"| {r.case} | {r.dtype} | {r.store_error:.3g} | {r.attention_error:.3g} | "
              f"{'PASS' if r.passed else 'FAIL'} |" for r in rows]
    return lines + [""]
