"""Survey of the linear-layer kernels torch offers on this CPU, at the model's shapes.

For each row count M it runs every linear layer of one forward pass (each layer its own
weights, so they stream from memory as in the engine; lm_head included) with each kernel,
and prints milliseconds, GFLOP/s, the speed-up over `aten-row` (F.linear on the [out, in]
weight: what transformers runs) and the largest absolute error against an fp64 reference
on one gate/up projection. This is the measurement behind the engine's CpuLinear
(docs/performance.md, change 7) and behind the kernels it does not use. The kernels take
turns (`--rounds` rounds at each row count, each round running every kernel once and a
plain read of as many bytes, `x.sum()`); the table gives each one's median, and GB/s as
the fp32 weight bytes over that time, next to the same run's x.sum() read bandwidth.

Kernels: aten-row; aten-col (F.linear on a column-major weight); onednn (fp32, weight
prepacked by oneDNN; bf16 weights too with --dtype bfloat16); gemv, gemv-avx2, gemv-avx512,
gemv-avx512-bf16 (native/csrc/gemv.cpp on the row-major weight: its widest path here, or one
forced; avx512-bf16 is the bf16 dot product, bf16 weights only); engine (CpuLinear:
gemv up to GEMV_MAX_ROWS rows of its code path, onednn for more); engine-before (CpuLinear
without the gemv: aten-col for one row on one thread, onednn otherwise);
fbgemm-fp16 (weights stored in fp16, fp32 math); fbgemm-int8 (int8 weights and dynamically
quantized int8 activations); int8-wo (int8 weight-only, per channel); int4-wo (4-bit
weight-only, groups of 32: the layout of the Q4_1 checkpoint). The last three change the
weights' values (fbgemm-int8 the activations too); the weight-only ones are scalar code
without AVX-512 and are timed only up to --max-slow-rows rows.

    .venv/bin/python bench/linear_kernels.py [--rows 1,16,256] [--threads 1] [--layers 30]
        [--kernels onednn,gemv,engine] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

Linear = Callable[[torch.Tensor], torch.Tensor]
GROUP = 32
SLOW = ("int8-wo", "int4-wo")


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


def _onednn(w: torch.Tensor) -> Linear:
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 2048)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _engine(w: torch.Tensor, gemv: bool = True) -> Linear:
    from conveyor.engine.model.cpu_linear import CpuLinear, onednn_packing_available

    return CpuLinear(w, None, pack=onednn_packing_available(w.dtype), gemv=gemv)


def _gemv(isa: str) -> Callable[[torch.Tensor], Linear]:
    def make(w: torch.Tensor) -> Linear:
        from conveyor.engine.model.cpu_linear import GEMV_ENTRIES, GEMV_ISAS, gemv_ops

        if isa == "avx512-bf16" and w.dtype != torch.bfloat16:
            raise SystemExit("gemv-avx512-bf16 multiplies bf16 weights: add --dtype bfloat16")
        ops = gemv_ops(w.dtype)
        if ops is None:
            raise SystemExit(f"the {w.dtype} GEMV did not build here (see the log)")
        linear, code = getattr(ops, GEMV_ENTRIES[w.dtype]), GEMV_ISAS[isa]
        return lambda x: linear(x, w, None, code)
    return make


def _fbgemm_fp16(w: torch.Tensor) -> Linear:
    packed = torch.ops.quantized.linear_prepack_fp16(w, None)
    return lambda x: torch.ops.quantized.linear_dynamic_fp16(x, packed)


def _aten_col(w: torch.Tensor) -> Linear:
    col = w.t().contiguous().t()
    return lambda x: F.linear(x, col)


KERNELS: dict[str, Callable[[torch.Tensor], Linear]] = {
    "aten-row": lambda w: (lambda x: F.linear(x, w)), "aten-col": _aten_col,
    "onednn": _onednn, "gemv": _gemv("auto"), "gemv-avx2": _gemv("avx2"),
    "gemv-avx512": _gemv("avx512"), "gemv-avx512-bf16": _gemv("avx512-bf16"), "engine": _engine,
    "engine-before": lambda w: _engine(w, gemv=False), "fbgemm-fp16": _fbgemm_fp16,
    "fbgemm-int8": _fbgemm_int8, "int8-wo": _int8_weight_only, "int4-wo": _int4_weight_only}


def forward_shapes(config: dict, layers: int) -> list[tuple[int, int]]:
    """(out, in) of every linear of a forward pass with `layers` layers, lm_head last."""
    from bench.roofline import model_shapes

    shapes = model_shapes(config)
    per_layer = [(s.out_features, s.in_features) for s in shapes[:-1]
                 for _ in range(s.per_forward // config["num_hidden_layers"])]
    return per_layer * layers + [(shapes[-1].out_features, shapes[-1].in_features)]


def time_forward(linears: list[tuple[int, Linear]], rows: int, repeats: int,
                 dtype: torch.dtype = torch.float32) -> float:
    """Seconds for one pass over `linears` (each (in_features, fn)) at `rows` rows of
    `dtype` (after one untimed pass)."""
    inputs = {k: torch.randn(rows, k, dtype=dtype) for k, _ in linears}
    for k, fn in linears:
        fn(inputs[k])
    start = time.perf_counter()
    for _ in range(repeats):
        for k, fn in linears:
            fn(inputs[k])
    return (time.perf_counter() - start) / repeats


def max_error(kernel: str, out_features: int, in_features: int, rows: int,
              dtype: torch.dtype = torch.float32) -> float:
    """Largest absolute error against fp64 on the same (dtype-rounded) weights and inputs."""
    torch.manual_seed(0)
    w = (torch.randn(out_features, in_features) * 0.02).to(dtype)
    x = torch.randn(rows, in_features).to(dtype)
    reference = F.linear(x.double(), w.double())
    return (KERNELS[kernel](w)(x).double() - reference).abs().max().item()


def time_read(data: torch.Tensor, repeats: int) -> float:
    """Seconds for one x.sum() over `data` (the plain-read reference), after one untimed."""
    data.sum()
    start = time.perf_counter()
    for _ in range(repeats):
        data.sum()
    return (time.perf_counter() - start) / repeats


def survey(config: dict, rows_list: list[int], kernels: list[str], layers: int,
           max_slow_rows: int, rounds: int = 3,
           dtype: torch.dtype = torch.float32) -> list[dict]:
    shapes = forward_shapes(config, layers)
    weights = [(torch.randn(n, k) * 0.02).to(dtype) for n, k in shapes]
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    flops_per_row = 2.0 * sum(n * k for n, k in shapes)
    gate_up = max(shapes[:-1])
    built = {kernel: [(w.shape[1], KERNELS[kernel](w)) for w in weights] for kernel in kernels}
    stream = torch.randn(weight_bytes // 4)
    seconds: dict[tuple[str, int], list[float]] = defaultdict(list)
    for rows in rows_list:
        repeats = 2 if rows <= 64 else 1
        for _ in range(rounds):  # the kernels take turns, so load changes hit them alike
            seconds[("x.sum()", rows)].append(time_read(stream, repeats))
            for kernel in kernels:
                if kernel in SLOW and rows > max_slow_rows:
                    continue
                seconds[(kernel, rows)].append(time_forward(built[kernel], rows, repeats,
                                                            dtype))
    results = []
    for (kernel, rows), times in seconds.items():
        median = statistics.median(times)
        results.append({"kernel": kernel, "rows": rows, "ms": median * 1e3,
                        "gflops": 0.0 if kernel == "x.sum()" else
                        flops_per_row * rows / median / 1e9,
                        "gbps": weight_bytes / median / 1e9,
                        "max_abs_error": 0.0 if kernel == "x.sum()" else
                        max_error(kernel, *gate_up, rows, dtype)})
    return results


def format_survey(results: list[dict]) -> str:
    base = {r["rows"]: r["ms"] for r in results if r["kernel"] == "aten-row"}
    read = {r["rows"]: r["gbps"] for r in results if r["kernel"] == "x.sum()"}
    lines = [f"{'kernel':13s} {'rows':>5s} {'ms':>9s} {'GFLOP/s':>8s} {'GB/s':>6s} "
             f"{'of x.sum()':>10s} {'vs aten-row':>11s} {'max abs err':>11s}"]
    for r in sorted(results, key=lambda r: (r["rows"], r["kernel"])):
        speedup = f"{base[r['rows']] / r['ms']:.2f}x" if r["rows"] in base else "-"
        share = f"{r['gbps'] / read[r['rows']]:.0%}" if r["rows"] in read else "-"
        lines.append(f"{r['kernel']:13s} {r['rows']:5d} {r['ms']:9.2f} {r['gflops']:8.1f} "
                     f"{r['gbps']:6.1f} {share:>10s} {speedup:>11s} {r['max_abs_error']:11.1e}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from bench.roofline import load_model_config

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,16,256")
    p.add_argument("--kernels", default=",".join(KERNELS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--layers", type=int, default=None, help="default: the model's")
    p.add_argument("--max-slow-rows", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3, help="turns each kernel takes per row count")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="weights and activations (bfloat16: the bf16 engine's linears)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = load_model_config()
    with torch.inference_mode():
        results = survey(config, [int(r) for r in args.rows.split(",")],
                         args.kernels.split(","), args.layers or config["num_hidden_layers"],
                         args.max_slow_rows, args.rounds, getattr(torch, args.dtype))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print(format_survey(results))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
