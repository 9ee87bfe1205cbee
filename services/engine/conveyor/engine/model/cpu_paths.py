"""The start-up log's line on what a CPU engine runs: the instruction sets found, the dtype, the
GEMM path, the attention kernels, the weights and the threads, read from the loaded model (what
its layers chose, not what was asked for), e.g.

    CPU avx2 avx512 avx512_vnni avx512_bf16 amx; dtype bfloat16; GEMM bf16 GEMV (avx512-bf16)
    up to 4 rows, oneDNN bf16 (AMX) above; attention native (decode avx512, prefill avx512);
    weights bf16, 269 MB of weights per decode step; 2 torch threads
"""

from __future__ import annotations

import torch
from torch import nn

from conveyor.engine.model.cpu_linear import CpuLinear
from conveyor.engine.model.quantized_linear import (
    DTYPE_NAMES,
    QuantizedLinear,
    describe_weight_format,
)
from conveyor.engine.native.cpu_features import CpuFeatures, cpu_features


def describe_cpu_paths(model: nn.Module, backend, dtype: torch.dtype) -> str:
    """One line: CPU features, dtype, GEMM path, attention kernels, weights, threads."""
    features = cpu_features()
    return (f"CPU {features.describe()}; dtype {str(dtype).removeprefix('torch.')}; "
            f"GEMM {describe_gemm(model, features)}; attention {describe_attention(backend)}; "
            f"weights {describe_weight_format(model)}; {torch.get_num_threads()} torch threads")


def describe_gemm(model: nn.Module, features: CpuFeatures) -> str:
    """The first linear layer's kernels (every layer of a model chooses alike): a weight
    format's block kernels for its decode steps, then the CpuLinear's."""
    quantized = next((m for m in model.modules() if isinstance(m, QuantizedLinear)), None)
    if quantized is not None:
        above = describe_dense(quantized.dense, features).removesuffix(" at every row count")
        return (f"{quantized.weight_format} blocks up to {quantized.max_rows} rows, "
                f"above that {above}")
    linear = next((m for m in model.modules() if isinstance(m, CpuLinear)), None)
    return "torch" if linear is None else describe_dense(linear, features)


def describe_dense(linear: CpuLinear, features: CpuFeatures) -> str:
    """A CpuLinear's GEMV (its path and row limit) and its kernel for larger steps."""
    name = DTYPE_NAMES.get(linear.weight.dtype, str(linear.weight.dtype))
    if linear.packed:
        large = f"oneDNN {name} ({onednn_isa(linear.weight.dtype, features)})"
    else:
        large = f"torch {name}"
    if not linear.streams:
        return f"{large} at every row count"
    return (f"{name} GEMV ({linear.gemv_path}) up to {linear.gemv_max_rows} rows, "
            f"{large} above")


def onednn_isa(dtype: torch.dtype, features: CpuFeatures) -> str:
    """The widest instructions oneDNN takes for `dtype` on this CPU."""
    if dtype == torch.bfloat16 and features.amx:
        return "AMX"
    if dtype == torch.bfloat16 and features.avx512_bf16:
        return "AVX512-BF16"
    return "AVX-512" if features.avx512 else "AVX2"


def describe_attention(backend) -> str:
    """The backend's name, and for native its decode and prefill code paths."""
    if backend.name != "native":
        return backend.name
    return f"native (decode {backend.kernel_path}, prefill {backend.prefill_kernel})"
