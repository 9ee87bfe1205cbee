"""The linear-layer kernels torch offers on this CPU at the model's shapes, a forward pass each.

Every linear of a forward pass (each its own weights, streamed from memory as in the engine;
lm_head included) at each row count, the kernels taking turns with a plain read of as many bytes
(`x.sum()`): ms, GFLOP/s, GB/s of weights and its share of x.sum()'s, the speed-up over
`aten-row` and the largest error against fp64 on a gate/up projection.

Kernels: aten-row (F.linear on the [out, in] weight, as transformers runs it); aten-col
(column-major weight); onednn (prepacked); gemv, gemv-avx2, gemv-avx512 (native/csrc/gemv.cpp:
its widest path or one forced); engine (CpuLinear); engine-before (CpuLinear without the gemv);
fbgemm-fp16; fbgemm-int8 (activations quantized too); int8-wo, int4-wo (weight-only, per channel
/ groups of 32; scalar without AVX-512, so timed up to 16 rows). The last four change the values.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
from tqdm import tqdm

from bench.kernels.harness import markdown_table, time_rounds
from bench.kernels.model_shapes import forward_shapes, load_model_config

Linear = Callable[[torch.Tensor], torch.Tensor]
GROUP = 32
SLOW = ("int8-wo", "int4-wo")
MAX_SLOW_ROWS = 16


def _int8_weight_only(w: torch.Tensor) -> Linear:
    scale = w.abs().amax(1).clamp_min(1e-8) / 127
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return lambda x: torch.ops.aten._weight_int8pack_mm(x, q, scale)


def _int4_weight_only(w: torch.Tensor) -> Linear:
    groups = w.view(w.shape[0], -1, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp_min(1e-8)
    q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        q.view_as(w).to(torch.int32), 1)
    scale_zero = torch.stack([scale.t(), (low + 8 * scale).t()], dim=-1).contiguous()
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scale_zero)


def _fbgemm_int8(w: torch.Tensor) -> Linear:
    scale = w.abs().amax(1).clamp_min(1e-8) / 127
    qw = torch.quantize_per_channel(w, scale.double(), torch.zeros(w.shape[0], dtype=torch.long),
                                    0, torch.qint8)
    packed = torch.ops.quantized.linear_prepack(qw, None)
    return lambda x: torch.ops.quantized.linear_dynamic(x, packed, True)


def _fbgemm_fp16(w: torch.Tensor) -> Linear:
    packed = torch.ops.quantized.linear_prepack_fp16(w, None)
    return lambda x: torch.ops.quantized.linear_dynamic_fp16(x, packed)


def _onednn(w: torch.Tensor) -> Linear:
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 2048)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _engine(w: torch.Tensor, gemv: bool = True) -> Linear:
    from conveyor.engine.model.cpu_linear import CpuLinear, onednn_packing_available

    return CpuLinear(w, None, pack=onednn_packing_available(w.dtype), gemv=gemv)


def _gemv(isa: str) -> Callable[[torch.Tensor], Linear]:
    def make(w: torch.Tensor) -> Linear:
        from conveyor.engine.model.cpu_linear import GEMV_ENTRIES, GEMV_ISAS, gemv_ops

        ops = gemv_ops(w.dtype)
        if ops is None:
            raise SystemExit(f"the {w.dtype} GEMV did not build here (see the log)")
        linear, code = getattr(ops, GEMV_ENTRIES[w.dtype]), GEMV_ISAS[isa]
        return lambda x: linear(x, w, None, code)
    return make


def _aten_col(w: torch.Tensor) -> Linear:
    col = w.t().contiguous().t()
    return lambda x: F.linear(x, col)


KERNELS: dict[str, Callable[[torch.Tensor], Linear]] = {
    "aten-row": lambda w: (lambda x: F.linear(x, w)), "aten-col": _aten_col,
    "onednn": _onednn, "gemv": _gemv("auto"), "gemv-avx2": _gemv("avx2"),
    "gemv-avx512": _gemv("avx512"), "engine": _engine,
    "engine-before": lambda w: _engine(w, gemv=False), "fbgemm-fp16": _fbgemm_fp16,
    "fbgemm-int8": _fbgemm_int8, "int8-wo": _int8_weight_only, "int4-wo": _int4_weight_only}
"""Kernel name -> a builder taking the [out, in] weight and giving `x -> x @ W^T`."""


def max_error(kernel: str, out_features: int, in_features: int, rows: int,
              dtype: torch.dtype) -> float:
    """Largest absolute error against fp64 on the same (dtype-rounded) weights and inputs."""
    torch.manual_seed(0)
    w = (torch.randn(out_features, in_features) * 0.02).to(dtype)
    x = torch.randn(rows, in_features).to(dtype)
    reference = F.linear(x.double(), w.double())
    return (KERNELS[kernel](w)(x).double() - reference).abs().max().item()


def forward_pass(linears: list[Linear], inputs: list[torch.Tensor]) -> Callable[[], None]:
    """The linears run back to back, each on its input."""
    def forward() -> None:
        for linear, x in zip(linears, inputs, strict=True):
            linear(x)
    return forward


def survey(config: dict, rows_list: list[int], kernels: list[str], rounds: int,
           dtype: torch.dtype = torch.float32) -> list[dict]:
    """A table row per (row count, kernel), x.sum() first."""
    shapes = forward_shapes(config)
    weights = [(torch.randn(n, k) * 0.02).to(dtype) for n, k in shapes]
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    flops_per_row = 2.0 * sum(n * k for n, k in shapes)
    built = {kernel: [KERNELS[kernel](w) for w in weights] for kernel in kernels}
    stream = torch.randn(weight_bytes // 4)
    table = []
    for rows in tqdm(rows_list, unit="row count", leave=False):
        inputs = [torch.randn(rows, k, dtype=dtype) for _, k in shapes]
        fns = {"x.sum()": stream.sum} | {
            kernel: forward_pass(built[kernel], inputs) for kernel in kernels
            if kernel not in SLOW or rows <= MAX_SLOW_ROWS}
        timings = time_rounds(fns, rounds, reps=2 if rows <= 64 else 1)
        read, base = timings["x.sum()"].median, timings.get("aten-row")
        for kernel, t in timings.items():
            measured = kernel != "x.sum()"
            table.append({
                "kernel": kernel, "rows": rows, "ms": t.ms, "±": t.spread_pct,
                "GFLOP/s": flops_per_row * rows / t.median / 1e9 if measured else "-",
                "GB/s": weight_bytes / t.median / 1e9, "of x.sum()": f"{read / t.median:.0%}",
                "vs aten-row": f"{base.median / t.median:.2f}x" if base else "-",
                "max abs err": max_error(kernel, *max(shapes[:-1]), rows, dtype)
                if measured else "-"})
    return table


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", default="1,16,256", help="row counts (tokens in a step)")
    p.add_argument("--kernels", default=",".join(KERNELS))
    p.add_argument("--rounds", type=int, default=3, help="turns each kernel takes per row count")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="weights and activations (bfloat16: the bf16 engine's linears)")


def run(args: argparse.Namespace) -> None:
    with torch.inference_mode():
        table = survey(load_model_config(), [int(r) for r in args.rows.split(",")],
                       args.kernels.split(","), args.rounds, getattr(torch, args.dtype))
    print(markdown_table(table))
