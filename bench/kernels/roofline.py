"""The practical roofline: the best matmul FLOP/s torch reaches here at the model's shapes.

For each batch size M it times `x[M, K] @ W[N, K]^T` for every linear layer shape of the model
and for all of them as one forward pass runs them (each use its own weight; lm_head included):
that composite is the roofline the engine's model FLOP/s is held to. A 2048^3 matmul shows the
machine's peak. Each figure is the best of `aten` (F.linear, as transformers runs it) and
`engine` (CpuLinear), the winner recorded. Model FLOPs: 2 x model_shapes.params_per_token x
tokens per second.
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from bench.kernels import linear
from bench.kernels.harness import markdown_table
from bench.kernels.model_shapes import (
    LinearShape,
    load_model_config,
    model_shapes,
    params_per_token,
)

BATCH_TOKENS = (1, 16, 64, 256, 512)
KERNELS = {"aten": linear.KERNELS["aten-row"], "engine": linear.KERNELS["engine"]}
"""Kernel name -> a builder taking the [out, in] weight and giving `x -> x @ W^T`."""


def _time_call(fn, min_time_s: float) -> float:
    """Best seconds per call over repeated runs totalling about `min_time_s`."""
    fn()
    best, spent = float("inf"), 0.0
    while spent < min_time_s:
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        best, spent = min(best, elapsed), spent + elapsed
    return best


def measure_shape(shape: LinearShape, tokens: int, dtype: torch.dtype,
                  min_time_s: float, kernel: str = "aten") -> float:
    """GFLOP/s of one linear layer at `tokens` rows."""
    return measure_forward([replace(shape, per_forward=1)], tokens, dtype, min_time_s, kernel)


def measure_forward(shapes: list[LinearShape], tokens: int, dtype: torch.dtype,
                    min_time_s: float, kernel: str = "aten") -> float:
    """GFLOP/s of all linear layers of one forward pass at `tokens` rows, run back to back.

    Each distinct shape has its own weight per use (no artificially warm cache).
    """
    x = {s.in_features: torch.randn(tokens, s.in_features, dtype=dtype) for s in shapes}
    uses = [(KERNELS[kernel](torch.randn(s.out_features, s.in_features, dtype=dtype)),
             x[s.in_features]) for s in shapes for _ in range(s.per_forward)]
    flops = sum(2.0 * tokens * s.out_features * s.in_features * s.per_forward for s in shapes)
    with torch.inference_mode():
        seconds = _time_call(linear.forward_pass(*zip(*uses, strict=True)), min_time_s)
    return flops / seconds / 1e9


def measure_peak(dtype: torch.dtype, min_time_s: float, size: int = 2048) -> float:
    """GFLOP/s of a square matmul: the machine's peak for comparison."""
    return measure_forward([LinearShape("square", size, size, 1)], size, dtype, min_time_s)


def _best(dtype: str, tokens: int, shape: str, gflops_of: Callable[[str], float]) -> dict:
    """The fastest of KERNELS (gflops_of: kernel name -> its GFLOP/s) as a measurement."""
    gflops, kernel = max((gflops_of(k), k) for k in KERNELS)
    return {"dtype": dtype, "tokens": tokens, "shape": shape, "gflops": gflops, "kernel": kernel}


def run_roofline(config: dict, dtypes: list[str], tokens_list=BATCH_TOKENS,
                 min_time_s: float = 0.3) -> dict:
    """All measurements as a JSON-ready dict; `forward` holds the per-M roofline."""
    shapes = model_shapes(config)
    out = {"threads": torch.get_num_threads(), "params_per_token": params_per_token(config),
           "shapes": [], "forward": [], "peak": {}}
    for name in dtypes:
        dtype = getattr(torch, name)
        out["peak"][name] = measure_peak(dtype, min_time_s)
        for m in tokens_list:
            out["shapes"] += [_best(name, m, s.name, functools.partial(
                measure_shape, s, m, dtype, min_time_s / 3)) for s in shapes]
            out["forward"].append(_best(name, m, "forward", functools.partial(
                measure_forward, shapes, m, dtype, min_time_s)))
    return out


def best_forward_gflops(result: dict, dtype: str = "float32") -> float:
    """The practical roofline: the best forward-pass GFLOP/s over the batch sizes."""
    return max(m["gflops"] for m in result["forward"] if m["dtype"] == dtype)


def format_roofline(result: dict) -> str:
    peaks = "; ".join(f"{dtype} {gf:.1f}" for dtype, gf in result["peak"].items())
    return (f"torch threads: {result['threads']}; parameters used per token: "
            f"{result['params_per_token'] / 1e6:.1f} M; peak square matmul 2048^3 GFLOP/s: "
            f"{peaks}\n" + markdown_table(result["shapes"] + result["forward"]))


def engine_threads() -> int:
    """The engine's thread count: CONVEYOR_ENGINE_TORCH_THREADS, else 0 (torch's default)."""
    return int(os.environ.get("CONVEYOR_ENGINE_TORCH_THREADS") or 0)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--tokens", default=",".join(map(str, BATCH_TOKENS)),
                   help="batch sizes M (rows of x)")


def run(args: argparse.Namespace) -> None:
    print(format_roofline(run_roofline(load_model_config(), args.dtypes.split(","),
                                       [int(t) for t in args.tokens.split(",")])))
