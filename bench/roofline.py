"""The practical roofline: the best matmul FLOP/s torch reaches here at the model's shapes.

For each batch size M (tokens in one step) it times `F.linear(x[M, K], W[N, K])` for every
linear layer shape of the model (SmolLM2-135M: q/o 576x576, k/v 192x576, gate/up 1536x576,
down 576x1536, lm_head 49152x576), and the whole set as one forward pass would run it
(30 layers + lm_head) -- that composite is the roofline the engine's model FLOP/s is held to.
A large square matmul shows the machine's peak for comparison.

Each measurement is the best of the kernels torch offers here for a linear layer: `aten`
(F.linear on the [out, in] weight, what transformers runs) and `engine` (the engine's
CpuLinear: a column-major GEMV for one row, oneDNN with a prepacked weight for more; see
services/engine/conveyor/engine/model/cpu_linear.py); the winning kernel is recorded.

Model FLOPs: 2 x parameters used per token x tokens per second, where the parameters used
per token are every linear layer's weights including lm_head (the embedding lookup is free).

    .venv/bin/python bench/roofline.py [--threads N] [--dtypes float32,bfloat16] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

BATCH_TOKENS = (1, 16, 64, 256, 512)


@dataclass(frozen=True, slots=True)
class LinearShape:
    name: str
    out_features: int
    in_features: int
    per_forward: int  # how many such matmuls one forward pass runs


@dataclass(frozen=True, slots=True)
class Measurement:
    dtype: str
    tokens: int
    shape: str
    gflops: float  # achieved GFLOP/s
    kernel: str = "aten"  # the fastest kernel (KERNELS)


def model_shapes(config: dict) -> list[LinearShape]:
    """The linear layers of a Llama-family config (HF config.json keys)."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config["num_key_value_heads"] * head_dim
    layers = config["num_hidden_layers"]
    return [
        LinearShape("q_proj", heads * head_dim, hidden, layers),
        LinearShape("k_proj/v_proj", kv, hidden, 2 * layers),
        LinearShape("o_proj", hidden, heads * head_dim, layers),
        LinearShape("gate_proj/up_proj", inter, hidden, 2 * layers),
        LinearShape("down_proj", hidden, inter, layers),
        LinearShape("lm_head", config["vocab_size"], hidden, 1),
    ]


def params_per_token(config: dict) -> int:
    """Weights every token is multiplied with: all linear layers, lm_head included."""
    return sum(s.out_features * s.in_features * s.per_forward for s in model_shapes(config))


def model_flops(config: dict, tokens_per_s: float) -> float:
    """The model FLOP/s of a throughput: 2 x parameters used per token x tokens/s."""
    return 2.0 * params_per_token(config) * tokens_per_s


def load_model_config(model: str = "smollm2-135m-instruct") -> dict:
    from conveyor.common.models import load_config, resolve_model

    return load_config(resolve_model(model)).to_dict()


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


def _aten_linear(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: F.linear(x, weight)


def _engine_linear(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    from conveyor.engine.model.cpu_linear import CpuLinear, onednn_packing_available

    return CpuLinear(weight, None, pack=onednn_packing_available(weight.dtype))


KERNELS: dict[str, Callable[[torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]] = {
    "aten": _aten_linear, "engine": _engine_linear}
"""Kernel name -> a builder taking the [out, in] weight and giving `x -> x @ W^T`."""


def measure_shape(shape: LinearShape, tokens: int, dtype: torch.dtype,
                  min_time_s: float, kernel: str = "aten") -> float:
    """GFLOP/s of one linear layer at `tokens` rows."""
    x = torch.randn(tokens, shape.in_features, dtype=dtype)
    linear = KERNELS[kernel](torch.randn(shape.out_features, shape.in_features, dtype=dtype))
    with torch.inference_mode():
        seconds = _time_call(lambda: linear(x), min_time_s)
    return 2.0 * tokens * shape.out_features * shape.in_features / seconds / 1e9


def measure_forward(shapes: list[LinearShape], tokens: int, dtype: torch.dtype,
                    min_time_s: float, kernel: str = "aten") -> float:
    """GFLOP/s of all linear layers of one forward pass at `tokens` rows, run back to back.

    Each distinct shape has its own weight per use (no artificially warm cache).
    """
    x = {s.in_features: torch.randn(tokens, s.in_features, dtype=dtype) for s in shapes}
    weights = [(x[s.in_features], s.out_features * s.in_features,
                KERNELS[kernel](torch.randn(s.out_features, s.in_features, dtype=dtype)))
               for s in shapes for _ in range(s.per_forward)]

    def forward():
        for inp, _, linear in weights:
            linear(inp)

    flops = sum(2.0 * tokens * size for _, size, _ in weights)
    with torch.inference_mode():
        seconds = _time_call(forward, min_time_s)
    return flops / seconds / 1e9


def measure_peak(dtype: torch.dtype, min_time_s: float, size: int = 2048) -> float:
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    with torch.inference_mode():
        seconds = _time_call(lambda: a @ b, min_time_s)
    return 2.0 * size**3 / seconds / 1e9


def run_roofline(config: dict, dtypes: list[str], tokens_list=BATCH_TOKENS,
                 min_time_s: float = 0.3) -> dict:
    """All measurements as a JSON-ready dict; `forward` holds the per-M roofline."""
    shapes = model_shapes(config)
    out = {"threads": torch.get_num_threads(), "params_per_token": params_per_token(config),
           "shapes": [], "forward": [], "peak": {}}
    for name in dtypes:
        dtype = getattr(torch, name)
        out["peak"][name] = measure_peak(dtype, min_time_s)
        for tokens in tokens_list:
            for shape in shapes:
                gf, kernel = max((measure_shape(shape, tokens, dtype, min_time_s / 3, k), k)
                                 for k in KERNELS)
                out["shapes"].append(asdict(Measurement(name, tokens, shape.name, gf, kernel)))
            gf, kernel = max((measure_forward(shapes, tokens, dtype, min_time_s, k), k)
                             for k in KERNELS)
            out["forward"].append(asdict(Measurement(name, tokens, "forward", gf, kernel)))
    return out


def best_forward_gflops(result: dict, dtype: str = "float32") -> float:
    """The practical roofline: the best forward-pass GFLOP/s over the batch sizes."""
    return max(m["gflops"] for m in result["forward"] if m["dtype"] == dtype)


def format_roofline(result: dict) -> str:
    lines = [f"torch threads: {result['threads']}; parameters used per token: "
             f"{result['params_per_token'] / 1e6:.1f} M"]
    for dtype, gf in result["peak"].items():
        lines.append(f"peak square matmul 2048^3 {dtype}: {gf:.1f} GFLOP/s")
    lines.append(f"{'dtype':9s} {'M':>4s} {'shape':18s} {'GFLOP/s':>9s} kernel")
    for m in result["shapes"] + result["forward"]:
        lines.append(f"{m['dtype']:9s} {m['tokens']:4d} {m['shape']:18s} {m['gflops']:9.1f} "
                     f"{m.get('kernel', 'aten')}")
    return "\n".join(lines)


def engine_threads() -> int:
    """The engine's thread count: CONVEYOR_ENGINE_TORCH_THREADS, else torch's default."""
    return int(os.environ.get("CONVEYOR_ENGINE_TORCH_THREADS") or 0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=engine_threads(),
                   help="torch threads (default: the engine's setting, else torch's default)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tokens = (1, 64, 512) if args.quick else BATCH_TOKENS
    result = run_roofline(load_model_config(), args.dtypes.split(","), tokens,
                          0.1 if args.quick else 0.3)
    print(format_roofline(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
